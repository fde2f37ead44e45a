"""The admin API under /admin/api (scope "admin" only; any other key gets 403, no key 401).

    GET    /admin/api/me                         who is calling
    GET    /admin/api/tenants                    tenants with enforced limits and usage against them
    POST   /admin/api/tenants                    {name, policy?, shared?} → 201
    GET    /admin/api/tenants/{tenant}           one tenant with its keys ({tenant} is an id or a name)
    PATCH  /admin/api/tenants/{tenant}           {policy?: {field: value|null}, suspended?, shared?}
    GET    /admin/api/tenants/{tenant}/usage     ?granularity=hour|day&hours=N (default 48 hours)
    GET    /admin/api/tenants/{tenant}/requests  per-request records, newest first: ?user=U&since=T&before=T&limit=N
                                                 (T: POSIX seconds; a page's `next_before` pages back)
    GET    /admin/api/tenants/{tenant}/adapters  ?include_deleted=true
    GET    /admin/api/tenants/{tenant}/keys      POST {name?, expires_in_s?, admin?} → 201 with the key once
    DELETE /admin/api/keys/{key_id}              revoke
    GET    /admin/api/adapters                   every tenant's live adapters, with worker residency
    GET    /admin/api/live                       queue depth by priority and tenant, workers, admission counters
    GET    /admin/api/overview                   the last minutes as chart series
    GET    /admin/api/audit                      ?limit=N&before_id=ID, newest first

Tenant and key handlers are in gateway/admin/tenants.py (policy edits, audit). Every store call of every
admin handler runs on a worker thread (`run_in_threadpool`), never on the event loop.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admin.context import gateway_of, int_param, require_admin, telemetry_of
from gateway.admin.tenants import (
    create_key,
    create_tenant,
    find_tenant,
    get_tenant,
    list_tenants,
    revoke_key,
    tenant_keys,
    tenant_usage,
    update_tenant,
)
from gateway.admin.views import adapter_json, audit_json, worker_json
from gateway.http.errors import invalid_request
from gateway.store import RequestRecord


async def me(request: Request) -> Response:
    user = require_admin(request)
    return JSONResponse({"tenant": user.tenant.name, "key_id": user.key.id, "scopes": sorted(user.key.scopes)})


async def tenant_requests(request: Request) -> Response:
    require_admin(request)
    store = gateway_of(request).store
    user = request.query_params.get("user") or None
    since, before = _time_param(request, "since"), _time_param(request, "before")
    limit = int_param(request, "limit", 50, 1, 1000)

    def collect() -> dict[str, Any]:
        tenant = find_tenant(store, request.path_params["tenant"])
        records = store.list_requests(tenant.id, user=user, since=since, before=before, limit=limit)
        return {"tenant_id": tenant.id, "requests": [_record_json(r) for r in records],
                "next_before": records[-1].created_at if len(records) == limit else None}

    return JSONResponse(await run_in_threadpool(collect))


def _record_json(record: RequestRecord) -> dict[str, Any]:
    out = dataclasses.asdict(record)
    out["finish_reasons"] = list(record.finish_reasons)
    out["total_tokens"] = record.prompt_tokens + record.completion_tokens
    return out


def _time_param(request: Request, name: str) -> float | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise invalid_request(f"{name} must be POSIX seconds, got {raw[:40]!r}.", param=name)
    return value


async def tenant_adapters(request: Request) -> Response:
    require_admin(request)
    store = gateway_of(request).store
    include_deleted = request.query_params.get("include_deleted", "false").lower() == "true"
    resident = await _resident(request)

    def collect() -> list[dict[str, Any]]:
        tenant = find_tenant(store, request.path_params["tenant"])
        records = store.list_adapters(tenant.id, include_shared=False, include_deleted=include_deleted)
        return [adapter_json(r, tenant.name, r.sha256 in resident) for r in records]

    return JSONResponse({"adapters": await run_in_threadpool(collect)})


async def all_adapters(request: Request) -> Response:
    require_admin(request)
    store = gateway_of(request).store
    resident = await _resident(request)

    def collect() -> list[dict[str, Any]]:
        return [adapter_json(r, tenant.name, r.sha256 in resident) for tenant in store.list_tenants()
                for r in store.list_adapters(tenant.id, include_shared=False)]

    return JSONResponse({"adapters": await run_in_threadpool(collect)})


async def _resident(request: Request) -> set[str]:
    worker = await telemetry_of(request).worker_state(gateway_of(request).engine)
    return set(worker.resident_adapters) if worker else set()


async def live(request: Request) -> Response:
    require_admin(request)
    state, telemetry = gateway_of(request), telemetry_of(request)
    queue = state.admission.queue
    names = {t.id: t.name for t in await run_in_threadpool(state.store.list_tenants)}
    worker = await telemetry.worker_state(state.engine)
    return JSONResponse({
        "at": time.time(),
        "queue": None if queue is None else {
            "by_priority": {str(p): d for p, d in queue.depth_by_priority().items()},
            "by_tenant": {names.get(t, t): d for t, d in queue.depth_by_tenant().items()},
            "waiting": queue.waiting, "in_flight": queue.in_flight, "capacity": queue.capacity,
        },
        "admission": state.admission.stats(),
        "workers": [worker_json(worker)] if worker else [],
        "worker_up": worker is not None,
    })


async def overview(request: Request) -> Response:
    require_admin(request)
    activity = telemetry_of(request).activity
    return JSONResponse({"bucket_s": activity.bucket_s, "series": activity.series()})


async def audit(request: Request) -> Response:
    require_admin(request)
    limit = int_param(request, "limit", 50, 1, 1000)
    raw_before = request.query_params.get("before_id")
    before_id = int_param(request, "before_id", 0, 1, 2**62) if raw_before is not None else None
    entries = await run_in_threadpool(lambda: gateway_of(request).store.list_audit(limit=limit, before_id=before_id))
    return JSONResponse({"entries": [audit_json(e) for e in entries]})


routes = [
    Route("/admin/api/me", me, methods=["GET"]),
    Route("/admin/api/tenants", list_tenants, methods=["GET"]),
    Route("/admin/api/tenants", create_tenant, methods=["POST"]),
    Route("/admin/api/tenants/{tenant}", get_tenant, methods=["GET"]),
    Route("/admin/api/tenants/{tenant}", update_tenant, methods=["PATCH"]),
    Route("/admin/api/tenants/{tenant}/usage", tenant_usage, methods=["GET"]),
    Route("/admin/api/tenants/{tenant}/requests", tenant_requests, methods=["GET"]),
    Route("/admin/api/tenants/{tenant}/adapters", tenant_adapters, methods=["GET"]),
    Route("/admin/api/tenants/{tenant}/keys", tenant_keys, methods=["GET"]),
    Route("/admin/api/tenants/{tenant}/keys", create_key, methods=["POST"]),
    Route("/admin/api/keys/{key_id}", revoke_key, methods=["DELETE"]),
    Route("/admin/api/adapters", all_adapters, methods=["GET"]),
    Route("/admin/api/live", live, methods=["GET"]),
    Route("/admin/api/overview", overview, methods=["GET"]),
    Route("/admin/api/audit", audit, methods=["GET"]),
]
