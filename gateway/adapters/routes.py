"""Tenant adapter API: upload, list, show, delete. Every route sees only the caller's own adapters.

    POST   /v1/adapters          multipart: file (.tar.gz/.tgz/.tar/.zip of a PEFT adapter), name, description?
                                 -> 201 the new version (re-uploading a name makes version N+1, the new default)
    GET    /v1/adapters          -> {"object": "list", "data": [adapter summary per name]}
    GET    /v1/adapters/{name}   -> the adapter with every live version (rank, targets, size, sha256, created)
    DELETE /v1/adapters/{name}   -> every version deleted; new requests naming it get 404 at once

Another tenant's adapter answers exactly like one that does not exist (404). Uploads have their own body
limit (`upload_body_limit()`, a `RouteBodySizeLimit` entry), larger than the API's, checked while the
body streams in, and so is the tenant's adapter byte quota (403 once the file passes what is left of it);
a body that stalls is dropped after `UploadLimits.read_timeout_s` (408), a tenant streams at most
`UploadLimits.max_concurrent` uploads at once (429), and no adapter may take the base model's name.
The work directory of an upload is removed on every outcome.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.adapters.registry import AdapterRegistry, invalid_adapter
from gateway.adapters.upload_stream import QUOTA_SLACK_BYTES, UploadForm, receive_upload
from gateway.auth.backend import TENANT_SCOPE, TenantUser, require_scope
from gateway.http.errors import ApiError, invalid_request
from gateway.store import AdapterRecord
from gateway.store.models import check_name

UPLOAD_PATH = "/v1/adapters"
UPLOAD_FILE_FIELD = "file"
MULTIPART_OVERHEAD_BYTES = 64 * 1024  # boundaries, part headers, name and description
MAX_DESCRIPTION_CHARS = 1000


def adapter_not_found(name: str) -> ApiError:
    return ApiError(404, f"The adapter '{name}' does not exist or you do not have access to it.",
                    param="name", code="adapter_not_found")


def version_json(record: AdapterRecord) -> dict:
    return {"object": "adapter.version", "id": record.ref, "name": record.name, "version": record.version,
            "sha256": record.sha256, "rank": record.rank, "target_modules": list(record.target_modules),
            "size_bytes": record.size_bytes, "description": record.description,
            "created": int(record.created_at), "shared": record.shared}


def adapter_json(versions: list[AdapterRecord]) -> dict:
    """One adapter name: its latest version's fields and every live version (oldest first)."""
    latest = max(versions, key=lambda r: r.version)
    return {"object": "adapter", "id": latest.name, "name": latest.name, "latest_version": latest.version,
            "sha256": latest.sha256, "rank": latest.rank, "target_modules": list(latest.target_modules),
            "size_bytes": latest.size_bytes, "description": latest.description, "created": int(latest.created_at),
            "versions": [version_json(r) for r in sorted(versions, key=lambda r: r.version)]}


@dataclass(frozen=True)
class UploadLimits:
    """How uploads are bounded besides their size: `read_timeout_s` (the longest wait for the next chunk
    of a body; then 408 and the connection closed) and `max_concurrent` (uploads one tenant may stream at
    once through this gateway; one more is a 429 before any byte is read)."""

    read_timeout_s: float = 30.0
    max_concurrent: int = 2

    def __post_init__(self) -> None:
        if self.read_timeout_s <= 0 or self.max_concurrent < 1:
            raise ValueError(f"upload limits must be positive, got {self}")


class AdapterApi:
    """The handlers over one AdapterRegistry (no module-level state: build_app makes one).

    `base_model`: the served model's name, which no adapter may take (a request naming it gets the base).
    """

    def __init__(self, registry: AdapterRegistry, base_model: str, limits: UploadLimits | None = None) -> None:
        self.registry = registry
        self.base_model = base_model
        self.limits = limits or UploadLimits()
        self._uploading: dict[str, int] = {}  # tenant id -> uploads streaming now (one event loop)

    @property
    def routes(self) -> list[BaseRoute]:
        return [
            Route(UPLOAD_PATH, self.upload_adapter, methods=["POST"]),
            Route(UPLOAD_PATH, self.list_adapters, methods=["GET"]),
            Route(UPLOAD_PATH + "/{name}", self.show_adapter, methods=["GET"]),
            Route(UPLOAD_PATH + "/{name}", self.delete_adapter, methods=["DELETE"]),
        ]

    async def upload_adapter(self, request: Request) -> Response:
        user = require_scope(request, TENANT_SCOPE)
        tenant_id = user.tenant.id
        if self._uploading.get(tenant_id, 0) >= self.limits.max_concurrent:
            raise ApiError(429, f"This tenant already has {self.limits.max_concurrent} adapter uploads in progress; "
                                "wait for one to finish.", code="too_many_uploads", error_type="rate_limit_error",
                           headers={"retry-after": "1"})
        self._uploading[tenant_id] = self._uploading.get(tenant_id, 0) + 1
        try:
            return await self._upload(request, user)
        finally:
            self._uploading[tenant_id] -= 1
            if not self._uploading[tenant_id]:
                del self._uploading[tenant_id]

    async def _upload(self, request: Request, user: TenantUser) -> Response:
        registry = self.registry
        config = registry.upload_config()
        await run_in_threadpool(registry.check_room, user.tenant)
        totals = await run_in_threadpool(registry.store.adapter_totals, user.tenant.id)
        room = max(0, user.tenant.policy.max_adapter_bytes - totals.size_bytes)
        work = await run_in_threadpool(registry.new_work_dir)
        try:
            form = UploadForm(UPLOAD_FILE_FIELD, frozenset({"name", "description"}), config.max_upload_bytes,
                              quota_bytes=room + QUOTA_SLACK_BYTES, read_timeout_s=self.limits.read_timeout_s)
            received = await receive_upload(request, work / "upload", form)
            name = _form_name(received.fields.get("name"))
            if name == self.base_model:
                raise invalid_request(f"'{name}' is the served base model's name; an adapter may not take it.",
                                      param="name", code="reserved_name")
            description = received.fields.get("description", "")
            if len(description) > MAX_DESCRIPTION_CHARS:
                raise invalid_request(f"description is longer than {MAX_DESCRIPTION_CHARS} characters.",
                                      param="description")
            try:
                record = await run_in_threadpool(registry.ingest, user.tenant, name, description, received.path, work)
            except RecursionError:  # a config nested deeper than Python recurses (a 400, never a 500)
                raise invalid_adapter("adapter_config.json is nested too deeply") from None
        finally:
            # NOTE: synchronous on purpose: it must run even when the request task is being cancelled.
            shutil.rmtree(work, ignore_errors=True)
        await run_in_threadpool(_audit, registry, user, "adapter.upload", record, version_json(record))
        return JSONResponse(version_json(record), status_code=201)

    async def list_adapters(self, request: Request) -> Response:
        user = require_scope(request, TENANT_SCOPE)
        by_name = await run_in_threadpool(self._live_by_name, user)
        return JSONResponse({"object": "list", "data": [adapter_json(v) for _, v in sorted(by_name.items())]})

    async def show_adapter(self, request: Request) -> Response:
        user = require_scope(request, TENANT_SCOPE)
        name = request.path_params["name"]
        versions = (await run_in_threadpool(self._live_by_name, user)).get(name)
        if not versions:
            raise adapter_not_found(name)
        return JSONResponse(adapter_json(versions))

    async def delete_adapter(self, request: Request) -> Response:
        user = require_scope(request, TENANT_SCOPE)
        name = request.path_params["name"]
        deleted = await run_in_threadpool(self.registry.delete, user.tenant, name)
        if not deleted:
            raise adapter_not_found(name)
        await self.registry.unload_from_workers(deleted)
        versions = sorted(r.version for r in deleted)
        await run_in_threadpool(_audit, self.registry, user, "adapter.delete", deleted[0], {"versions": versions})
        return JSONResponse({"object": "adapter.deleted", "id": name, "name": name, "deleted": True,
                             "versions": versions})

    def _live_by_name(self, user: TenantUser) -> dict[str, list[AdapterRecord]]:
        by_name: dict[str, list[AdapterRecord]] = {}
        for record in self.registry.store.list_adapters(user.tenant.id, include_shared=False):
            if record.tenant_id == user.tenant.id and record.deleted_at is None:
                by_name.setdefault(record.name, []).append(record)
        return by_name


def _form_name(value: str | None) -> str:
    if not value:
        raise invalid_request("The upload needs a 'name' field: the adapter's name.", param="name")
    try:
        return check_name("adapter", value)
    except ValueError as e:
        raise invalid_request(f"{str(e)[0].upper()}{str(e)[1:]}.", param="name") from None


def _audit(registry: AdapterRegistry, user: TenantUser, action: str, record: AdapterRecord, after: dict) -> None:
    registry.store.append_audit(user.key.id, action, f"{record.tenant_id}/{record.name}", after=after)


def upload_body_limit(upload_max_bytes: int) -> dict[tuple[str, str], int]:
    """The body limit of the upload route, for `gateway.http.middleware.RouteBodySizeLimit`."""
    return {("POST", UPLOAD_PATH): upload_max_bytes + MULTIPART_OVERHEAD_BYTES}
