"""Admin handlers for tenants and their keys: list, create, show, update (policy, suspension, sharing),
usage, keys, revocation. The route table and the API's overview are in gateway/admin/routes.py.

Every change is appended to the audit log (actor = the admin key's id, before/after values). A policy
in a POST or PATCH goes through `TenantPolicy.with_changes`, the parser every path uses: a policy the
gateway would not enforce as written is a 400 `invalid_policy` naming the field (param
"policy.<field>"), and nothing is stored. Edits take effect on the tenant's next request.

Every store call runs on a worker thread (`run_in_threadpool`), never on the event loop: a handler's
reads and writes are one function there, so a slow store (a SQLite write waiting for its lock, a Redis
round trip) holds a thread, not every other request.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.admin.context import gateway_of, int_param, parse_json_body, require_admin, telemetry_of
from gateway.admin.views import (
    key_json,
    tenant_detail_json,
    tenant_json,
    tenant_row,
    usage_row_json,
    usage_totals_json,
)
from gateway.auth.backend import ADMIN_SCOPE, TENANT_SCOPE
from gateway.http.errors import ApiError, invalid_request
from gateway.store import AlreadyExistsError, Store, Tenant
from policies import InvalidPolicy, TenantPolicy

MAX_USAGE_HOURS = 24 * 90


class CreateTenant(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    policy: dict[str, Any] = Field(default_factory=dict)  # fields to set; a null value means the default
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


def find_tenant(store: Store, ident: str) -> Tenant:
    """The tenant named by id or name, else 404. Reads the store: call it on a worker thread."""
    tenant = store.get_tenant(ident) or store.get_tenant_by_name(ident)
    if tenant is None:
        raise ApiError(404, f"No tenant with id or name {ident!r}.", code="tenant_not_found")
    return tenant


def _changed_policy(policy: TenantPolicy, patch: dict[str, Any]) -> TenantPolicy:
    """`policy` with an operator's patch applied, or the 400 every admin route answers for a bad one."""
    try:
        return policy.with_changes(patch)
    except InvalidPolicy as e:
        param = "policy" if e.field == "policy" else f"policy.{e.field}"
        raise invalid_request(f"{str(e)[0].upper()}{str(e)[1:]}.", param=param, code="invalid_policy") from None


async def list_tenants(request: Request) -> Response:
    require_admin(request)
    store = gateway_of(request).store
    recent = telemetry_of(request).activity.requests_in_last(60.0)

    def rows() -> list[dict[str, Any]]:
        now = time.time()
        return [tenant_row(tenant, store.day_totals(tenant.id), recent.get(tenant.name, 0),
                           sum(1 for k in store.list_api_keys(tenant.id) if k.is_usable(now)))
                for tenant in store.list_tenants()]

    return JSONResponse({"tenants": await run_in_threadpool(rows)})


async def create_tenant(request: Request) -> Response:
    user = require_admin(request)
    body: CreateTenant = await parse_json_body(request, CreateTenant)
    policy = _changed_policy(TenantPolicy(), body.policy)
    store = gateway_of(request).store

    def create() -> Tenant:
        try:
            tenant = store.create_tenant(body.name, policy=policy, shared=body.shared)
        except AlreadyExistsError:
            raise ApiError(409, f"A tenant named {body.name!r} already exists.", code="tenant_exists") from None
        except ValueError as e:  # a name the store refuses
            raise invalid_request(str(e), param="name") from None
        store.append_audit(user.key.id, "tenant.create", tenant.id, after=tenant_json(tenant))
        return tenant

    return JSONResponse(tenant_json(await run_in_threadpool(create)), status_code=201)


async def get_tenant(request: Request) -> Response:
    require_admin(request)
    store = gateway_of(request).store

    def show() -> dict[str, Any]:
        tenant = find_tenant(store, request.path_params["tenant"])
        return {**tenant_detail_json(tenant), "keys": [key_json(k) for k in store.list_api_keys(tenant.id)]}

    return JSONResponse(await run_in_threadpool(show))


async def update_tenant(request: Request) -> Response:
    user = require_admin(request)
    body: UpdateTenant = await parse_json_body(request, UpdateTenant)
    store = gateway_of(request).store

    def update() -> Tenant:
        tenant = find_tenant(store, request.path_params["tenant"])
        if body.policy is not None:  # checked before anything is written
            before, after = store.update_policy(tenant.id, _changed_policy(tenant.policy, body.policy))
            store.append_audit(user.key.id, "tenant.policy.update", tenant.id, before=before.overrides(),
                               after=after.overrides())
        if body.suspended is not None and body.suspended != tenant.suspended:
            store.set_suspended(tenant.id, body.suspended)
            store.append_audit(user.key.id, "tenant.suspend" if body.suspended else "tenant.resume", tenant.id,
                               before={"suspended": tenant.suspended}, after={"suspended": body.suspended})
        if body.shared is not None and body.shared != tenant.shared:
            store.set_tenant_shared(tenant.id, body.shared)
            store.append_audit(user.key.id, "tenant.shared.update", tenant.id,
                               before={"shared": tenant.shared}, after={"shared": body.shared})
        return find_tenant(store, tenant.id)

    return JSONResponse(tenant_detail_json(await run_in_threadpool(update)))


async def tenant_usage(request: Request) -> Response:
    require_admin(request)
    store = gateway_of(request).store
    asked = request.query_params.get("granularity", "hour")
    if asked not in ("hour", "day"):
        raise invalid_request("granularity must be 'hour' or 'day'.", param="granularity")
    granularity: Literal["hour", "day"] = "day" if asked == "day" else "hour"
    hours = int_param(request, "hours", 48, 1, MAX_USAGE_HOURS)

    def report() -> dict[str, Any]:
        tenant = find_tenant(store, request.path_params["tenant"])
        now = time.time()
        rows = store.usage(tenant.id, now - hours * 3600.0, now, granularity)
        totals = store.usage_totals(tenant.id, now - hours * 3600.0, now)
        return {"tenant_id": tenant.id, "granularity": granularity, "hours": hours,
                "rows": [usage_row_json(r) for r in rows], "totals": usage_totals_json(totals)}

    return JSONResponse(await run_in_threadpool(report))


async def tenant_keys(request: Request) -> Response:
    require_admin(request)
    store = gateway_of(request).store

    def keys() -> list[dict[str, Any]]:
        return [key_json(k) for k in store.list_api_keys(find_tenant(store, request.path_params["tenant"]).id)]

    return JSONResponse({"keys": await run_in_threadpool(keys)})


async def create_key(request: Request) -> Response:
    user = require_admin(request)
    body: CreateKey = await parse_json_body(request, CreateKey)
    store = gateway_of(request).store
    scopes = {ADMIN_SCOPE} if body.admin else {TENANT_SCOPE}
    expires_at = time.time() + body.expires_in_s if body.expires_in_s else None

    def create() -> dict[str, Any]:
        tenant = find_tenant(store, request.path_params["tenant"])
        plaintext, key = store.create_api_key(tenant.id, scopes=scopes, name=body.name, expires_at=expires_at)
        store.append_audit(user.key.id, "key.create", key.id,
                           after={"tenant": tenant.id, "scopes": sorted(scopes), "name": body.name})
        return {**key_json(key), "key": plaintext}

    return JSONResponse(await run_in_threadpool(create), status_code=201)


async def revoke_key(request: Request) -> Response:
    user = require_admin(request)
    store = gateway_of(request).store
    key_id = request.path_params["key_id"]

    def revoke() -> dict[str, Any]:
        before = store.get_api_key(key_id)
        if before is None:
            raise ApiError(404, f"No API key with id {key_id!r}.", code="key_not_found")
        key = store.revoke_api_key(key_id)
        store.append_audit(user.key.id, "key.revoke", key.id,
                           before={"status": "active" if before.revoked_at is None else "revoked"},
                           after={"status": "revoked"})
        return key_json(key)

    return JSONResponse(await run_in_threadpool(revoke))


