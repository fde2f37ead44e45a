"""Tenant adapter API: upload, list, show, delete. Every route sees only the caller's own adapters.

    POST   /v1/adapters          multipart: file (.tar.gz/.tgz/.tar/.zip of a PEFT adapter), name, description?
                                 -> 201 the new version (re-uploading a name makes version N+1, the new default)
    GET    /v1/adapters          -> {"object": "list", "data": [adapter summary per name]}
    GET    /v1/adapters/{name}   -> the adapter with every live version (rank, targets, size, sha256, created)
    DELETE /v1/adapters/{name}   -> every version deleted; new requests naming it get 404 at once

Another tenant's adapter answers exactly like one that does not exist (404). Uploads have their own body
limit (`upload_body_limit()`, a `RouteBodySizeLimit` entry), larger than the API's, checked while the
body streams in.
"""

from __future__ import annotations

import shutil

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.adapters.registry import AdapterRegistry
from gateway.adapters.upload_stream import UploadForm, receive_upload
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


class AdapterApi:
    """The handlers over one AdapterRegistry (no module-level state: build_app makes one)."""

    def __init__(self, registry: AdapterRegistry) -> None:
        self.registry = registry

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
        registry = self.registry
        config = registry.upload_config()
        await run_in_threadpool(registry.check_room, user.tenant)
        work = await run_in_threadpool(registry.new_work_dir)
        try:
            form = UploadForm(UPLOAD_FILE_FIELD, frozenset({"name", "description"}), config.max_upload_bytes)
            received = await receive_upload(request, work / "upload", form)
            name = _form_name(received.fields.get("name"))
            description = received.fields.get("description", "")
            if len(description) > MAX_DESCRIPTION_CHARS:
                raise invalid_request(f"description is longer than {MAX_DESCRIPTION_CHARS} characters.",
                                      param="description")
            record = await run_in_threadpool(registry.ingest, user.tenant, name, description, received.path, work)
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
