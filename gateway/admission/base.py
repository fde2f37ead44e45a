"""The two seams of the request path that quota and queueing policies plug into.

`RequestAdmission.admit` is called once per request, after the body is validated and the prompt is
tokenized and before anything reaches a worker: it may refuse (raise ApiError: 429, 503, 400) or grant,
choosing the priority the request runs at. `RequestAdmission.release` is called exactly once per
granted request, with the final token counts, whatever the outcome (finished, failed, client gone).
`UsageReporter.report` is the one place final usage is recorded durably.

The defaults here only clamp the priority into the tenant's range and record usage in the store; the
policies package supplies an admission with quotas and a fair queue.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.concurrency import run_in_threadpool

from gateway.store import Store, Tenant

log = logging.getLogger(__name__)

DEFAULT_MIN_PRIORITY = 0
DEFAULT_MAX_PRIORITY = 9
DEFAULT_PRIORITY = 0


@dataclass(frozen=True)
class AdmissionRequest:
    request_id: str
    tenant: Tenant
    model: str
    requested_priority: int | None
    prompt_tokens: int
    max_tokens: int  # per sample
    n: int


@dataclass(frozen=True)
class Admitted:
    priority: int
    headers: dict[str, str]  # e.g. x-ratelimit-* to send with the response
    handle: Any = None  # whatever the admission needs back at release (a quota lease, a queue ticket)


@dataclass(frozen=True)
class FinalUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    outcome: str  # "ok" | "error" | "disconnected"


class RequestAdmission(Protocol):
    async def admit(self, request: AdmissionRequest) -> Admitted: ...

    async def release(self, request: AdmissionRequest, admitted: Admitted, usage: FinalUsage) -> None: ...


class PriorityClampAdmission:
    """Admits everything; the priority is the requested one (or the tenant's default) clamped into the
    tenant policy's [min_priority, max_priority] (keys read from Tenant.policy when present)."""

    async def admit(self, request: AdmissionRequest) -> Admitted:
        policy = request.tenant.policy
        lo = _int(policy.get("min_priority"), DEFAULT_MIN_PRIORITY)
        hi = max(lo, _int(policy.get("max_priority"), DEFAULT_MAX_PRIORITY))
        wanted = request.requested_priority
        if wanted is None:
            wanted = _int(policy.get("default_priority"), max(lo, DEFAULT_PRIORITY))
        return Admitted(priority=min(max(wanted, lo), hi), headers={})

    async def release(self, request: AdmissionRequest, admitted: Admitted, usage: FinalUsage) -> None:
        return None


class UsageReporter(Protocol):
    async def report(self, tenant: Tenant, usage: FinalUsage) -> None: ...


class StoreUsageReporter:
    """Adds each finished request to the tenant's hourly usage counters in the store."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def report(self, tenant: Tenant, usage: FinalUsage) -> None:
        try:
            await run_in_threadpool(
                self.store.record_usage, tenant.id, None, 1, usage.prompt_tokens, usage.completion_tokens,
                usage.cached_tokens,
            )
        except Exception:  # usage must never turn a served request into an error
            log.exception("could not record usage for tenant %s", tenant.id)


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default
