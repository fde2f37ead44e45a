"""The admin API under /admin/api (scope "admin" only; any other key gets 403, no key 401).

    GET    /admin/api/me                         who is calling
    GET    /admin/api/tenants                    tenants with enforced limits and usage against them
    POST   /admin/api/tenants                    {name, policy?, shared?} → 201
    GET    /admin/api/tenants/{tenant}           one tenant with its keys ({tenant} is an id or a name)
    PATCH  /admin/api/tenants/{tenant}           {policy?: {field: value|null}, suspended?, shared?}
    GET    /admin/api/tenants/{tenant}/usage     ?granularity=hour|day&hours=N (default 48 hours)
    GET    /admin/api/tenants/{tenant}/adapters  ?include_deleted=true
    GET    /admin/api/tenants/{tenant}/keys      POST {name?, expires_in_s?, admin?} → 201 with the key once
    DELETE /admin/api/keys/{key_id}              revoke
    GET    /admin/api/adapters                   every tenant's live adapters, with worker residency
    GET    /admin/api/live                       queue depth by priority and tenant, workers, admission counters
    GET    /admin/api/overview                   the last minutes as chart series
    GET    /admin/api/audit                      ?limit=N&before_id=ID, newest first

Every change is appended to the audit log (actor = the admin key's id, before/after values). Policy
edits take effect on the tenant's next request: admission reads the policy from the store each time.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admin.views import (
    PolicyError,
    adapter_json,
    audit_json,
    effective_policy,
    key_json,
    merge_policy,
    tenant_json,
    tenant_row,
    usage_row_json,
    usage_totals_json,
    worker_json,
)
from gateway.auth.backend import ADMIN_SCOPE, TENANT_SCOPE, TenantUser, require_scope
from gateway.http.errors import ApiError, invalid_request
from gateway.observability.telemetry import TELEMETRY_STATE_KEY, Telemetry
from gateway.openai.schema import parse_body
from gateway.state import GatewayState
from gateway.store import AlreadyExistsError, Store, Tenant
from policies import TenantPolicy

MAX_USAGE_HOURS = 24 * 90


class CreateTenant(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    policy: dict[str, Any] = Field(default_factory=dict)
    shared: bool = False


class UpdateTenant(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy: dict[str, Any] | None = None  # fields to change; a null value restores that field's default
    suspended: bool | None = None
    shared: bool | None = None


class CreateKey(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(default="", max_length=200)
    expires_in_s: float | None = Field(default=None, gt=0)
    admin: bool = False


def _admin(request: Request) -> TenantUser:
    return require_scope(request, ADMIN_SCOPE)  # 403 for any key without the admin scope


def _gateway(request: Request) -> GatewayState:
    return request.state.gateway


def _telemetry(request: Request) -> Telemetry:
    return getattr(request.state, TELEMETRY_STATE_KEY)


def _tenant(store: Store, ident: str) -> Tenant:
    tenant = store.get_tenant(ident) or store.get_tenant_by_name(ident)
    if tenant is None:
        raise ApiError(404, f"No tenant with id or name {ident!r}.", code="tenant_not_found")
    return tenant


async def _body(request: Request, model: type[BaseModel]) -> Any:
    return parse_body(await request.body(), model)


async def me(request: Request) -> Response:
    user = _admin(request)
    return JSONResponse({"tenant": user.tenant.name, "key_id": user.key.id, "scopes": sorted(user.key.scopes)})


async def list_tenants(request: Request) -> Response:
    _admin(request)
    store = _gateway(request).store
    recent = _telemetry(request).activity.requests_in_last(60.0)

    def rows() -> list[dict[str, Any]]:
        out = []
        for tenant in store.list_tenants():
            active = sum(1 for k in store.list_api_keys(tenant.id) if k.is_usable(time.time()))
            out.append(tenant_row(tenant, _limits(tenant), store.day_totals(tenant.id), recent.get(tenant.name, 0),
                                  active))
        return out

    return JSONResponse({"tenants": await run_in_threadpool(rows)})


async def create_tenant(request: Request) -> Response:
    user = _admin(request)
    body: CreateTenant = await _body(request, CreateTenant)
    store = _gateway(request).store
    probe = Tenant(id="-", name=body.name, created_at=0.0, suspended=False, policy={}, cache_salt="")
    try:
        effective_policy(probe, merge_policy({}, body.policy))
        tenant = await run_in_threadpool(store.create_tenant, body.name, policy=merge_policy({}, body.policy),
                                         shared=body.shared)
    except AlreadyExistsError:
        raise ApiError(409, f"A tenant named {body.name!r} already exists.", code="tenant_exists") from None
    except ValueError as e:  # PolicyError, or a name the store refuses
        raise invalid_request(str(e)) from None
    await run_in_threadpool(store.append_audit, user.key.id, "tenant.create", tenant.id, after=tenant_json(tenant))
    return JSONResponse(tenant_json(tenant), status_code=201)


async def get_tenant(request: Request) -> Response:
    _admin(request)
    store = _gateway(request).store
    tenant = _tenant(store, request.path_params["tenant"])
    keys = await run_in_threadpool(store.list_api_keys, tenant.id)
    return JSONResponse({**tenant_json(tenant), "limits": _limits(tenant).model_dump(),
                         "keys": [key_json(k) for k in keys]})


def _limits(tenant: Tenant) -> TenantPolicy:
    """The enforced limits (the defaults when the stored policy is invalid, as admission does)."""
    try:
        return effective_policy(tenant)
    except PolicyError:
        return effective_policy(tenant, {})


async def update_tenant(request: Request) -> Response:
    user = _admin(request)
    body: UpdateTenant = await _body(request, UpdateTenant)
    store = _gateway(request).store
    tenant = _tenant(store, request.path_params["tenant"])
    if body.policy is not None:
        try:
            merged = merge_policy(tenant.policy, body.policy)
            effective_policy(tenant, merged)
        except PolicyError as e:
            raise invalid_request(str(e), param="policy", code="invalid_policy") from None
        before, after = await run_in_threadpool(store.update_policy, tenant.id, merged)
        await run_in_threadpool(store.append_audit, user.key.id, "tenant.policy.update", tenant.id,
                                before=before, after=after)
    if body.suspended is not None and body.suspended != tenant.suspended:
        await run_in_threadpool(store.set_suspended, tenant.id, body.suspended)
        await run_in_threadpool(store.append_audit, user.key.id,
                                "tenant.suspend" if body.suspended else "tenant.resume", tenant.id,
                                before={"suspended": tenant.suspended}, after={"suspended": body.suspended})
    if body.shared is not None and body.shared != tenant.shared:
        await run_in_threadpool(store.set_tenant_shared, tenant.id, body.shared)
        await run_in_threadpool(store.append_audit, user.key.id, "tenant.shared.update", tenant.id,
                                before={"shared": tenant.shared}, after={"shared": body.shared})
    updated = _tenant(store, tenant.id)
    return JSONResponse({**tenant_json(updated), "limits": _limits(updated).model_dump()})


async def tenant_usage(request: Request) -> Response:
    _admin(request)
    store = _gateway(request).store
    tenant = _tenant(store, request.path_params["tenant"])
    asked = request.query_params.get("granularity", "hour")
    if asked not in ("hour", "day"):
        raise invalid_request("granularity must be 'hour' or 'day'.", param="granularity")
    granularity: Literal["hour", "day"] = "day" if asked == "day" else "hour"
    hours = _int_param(request, "hours", 48, 1, MAX_USAGE_HOURS)
    now = time.time()
    rows = await run_in_threadpool(store.usage, tenant.id, now - hours * 3600.0, now, granularity)
    totals = await run_in_threadpool(store.usage_totals, tenant.id, now - hours * 3600.0, now)
    return JSONResponse({"tenant_id": tenant.id, "granularity": granularity, "hours": hours,
                         "rows": [usage_row_json(r) for r in rows], "totals": usage_totals_json(totals)})


async def tenant_adapters(request: Request) -> Response:
    _admin(request)
    state = _gateway(request)
    tenant = _tenant(state.store, request.path_params["tenant"])
    include_deleted = request.query_params.get("include_deleted", "false").lower() == "true"
    records = await run_in_threadpool(state.store.list_adapters, tenant.id, include_shared=False,
                                      include_deleted=include_deleted)
    resident = await _resident(request)
    return JSONResponse({"adapters": [adapter_json(r, tenant.name, r.sha256 in resident) for r in records]})


async def all_adapters(request: Request) -> Response:
    _admin(request)
    store = _gateway(request).store
    resident = await _resident(request)

    def collect() -> list[dict[str, Any]]:
        out = []
        for tenant in store.list_tenants():
            for r in store.list_adapters(tenant.id, include_shared=False):
                out.append(adapter_json(r, tenant.name, r.sha256 in resident))
        return out

    return JSONResponse({"adapters": await run_in_threadpool(collect)})


async def _resident(request: Request) -> set[str]:
    worker = await _telemetry(request).worker_state(_gateway(request).engine)
    return set(worker.resident_adapters) if worker else set()


async def tenant_keys(request: Request) -> Response:
    _admin(request)
    store = _gateway(request).store
    tenant = _tenant(store, request.path_params["tenant"])
    keys = await run_in_threadpool(store.list_api_keys, tenant.id)
    return JSONResponse({"keys": [key_json(k) for k in keys]})


async def create_key(request: Request) -> Response:
    user = _admin(request)
    body: CreateKey = await _body(request, CreateKey)
    store = _gateway(request).store
    tenant = _tenant(store, request.path_params["tenant"])
    scopes = {ADMIN_SCOPE} if body.admin else {TENANT_SCOPE}
    expires_at = time.time() + body.expires_in_s if body.expires_in_s else None
    plaintext, key = await run_in_threadpool(
        lambda: store.create_api_key(tenant.id, scopes=scopes, name=body.name, expires_at=expires_at))
    await run_in_threadpool(store.append_audit, user.key.id, "key.create", key.id,
                            after={"tenant": tenant.id, "scopes": sorted(scopes), "name": body.name})
    return JSONResponse({**key_json(key), "key": plaintext}, status_code=201)


async def revoke_key(request: Request) -> Response:
    user = _admin(request)
    store = _gateway(request).store
    key_id = request.path_params["key_id"]
    before = store.get_api_key(key_id)
    if before is None:
        raise ApiError(404, f"No API key with id {key_id!r}.", code="key_not_found")
    key = await run_in_threadpool(store.revoke_api_key, key_id)
    await run_in_threadpool(store.append_audit, user.key.id, "key.revoke", key.id,
                            before={"status": "active" if before.revoked_at is None else "revoked"},
                            after={"status": "revoked"})
    return JSONResponse(key_json(key))


async def live(request: Request) -> Response:
    _admin(request)
    state, telemetry = _gateway(request), _telemetry(request)
    queue = getattr(state.admission, "queue", None)
    names = {t.id: t.name for t in await run_in_threadpool(state.store.list_tenants)}
    worker = await telemetry.worker_state(state.engine)
    stats = getattr(state.admission, "stats", None)
    return JSONResponse({
        "at": time.time(),
        "queue": None if queue is None else {
            "by_priority": {str(p): d for p, d in queue.depth_by_priority().items()},
            "by_tenant": {names.get(t, t): d for t, d in queue.depth_by_tenant().items()},
            "waiting": getattr(queue, "waiting", None), "in_flight": getattr(queue, "in_flight", None),
            "capacity": getattr(queue, "capacity", None),
        },
        "admission": stats() if callable(stats) else {},
        "workers": [worker_json(worker)] if worker else [],
        "worker_up": worker is not None,
    })


async def overview(request: Request) -> Response:
    _admin(request)
    activity = _telemetry(request).activity
    return JSONResponse({"bucket_s": activity.bucket_s, "series": activity.series()})


async def audit(request: Request) -> Response:
    _admin(request)
    limit = _int_param(request, "limit", 50, 1, 1000)
    raw_before = request.query_params.get("before_id")
    before_id = _int_param(request, "before_id", 0, 1, 2**62) if raw_before is not None else None
    entries = await run_in_threadpool(lambda: _gateway(request).store.list_audit(limit=limit, before_id=before_id))
    return JSONResponse({"entries": [audit_json(e) for e in entries]})


def _int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise invalid_request(f"{name} must be an integer, got {raw!r}.", param=name) from None
    if not lo <= value <= hi:
        raise invalid_request(f"{name} must be in [{lo}, {hi}], got {value}.", param=name)
    return value


routes = [
    Route("/admin/api/me", me, methods=["GET"]),
    Route("/admin/api/tenants", list_tenants, methods=["GET"]),
    Route("/admin/api/tenants", create_tenant, methods=["POST"]),
    Route("/admin/api/tenants/{tenant}", get_tenant, methods=["GET"]),
    Route("/admin/api/tenants/{tenant}", update_tenant, methods=["PATCH"]),
    Route("/admin/api/tenants/{tenant}/usage", tenant_usage, methods=["GET"]),
    Route("/admin/api/tenants/{tenant}/adapters", tenant_adapters, methods=["GET"]),
    Route("/admin/api/tenants/{tenant}/keys", tenant_keys, methods=["GET"]),
    Route("/admin/api/tenants/{tenant}/keys", create_key, methods=["POST"]),
    Route("/admin/api/keys/{key_id}", revoke_key, methods=["DELETE"]),
    Route("/admin/api/adapters", all_adapters, methods=["GET"]),
    Route("/admin/api/live", live, methods=["GET"]),
    Route("/admin/api/overview", overview, methods=["GET"]),
    Route("/admin/api/audit", audit, methods=["GET"]),
]
