"""The two seams of the request path that quota and queueing policies plug into.

`RequestAdmission.admit` is called once per request, after the body is validated and the prompt is
tokenized and before anything reaches a worker: it may refuse (raise ApiError: 429, 503, 400) or grant,
choosing the priority the request runs at. `RequestAdmission.release` is called exactly once per
granted request, with the final token counts, whatever the outcome (finished, failed, client gone).
`close` is called once at shutdown, after the last release; `queue` is the fair queue the dashboard and
/metrics show (None: the admission has none).
`UsageReporter.report` is the one place final usage is recorded durably (the tenant's hourly counters and,
given the request's `RequestLabels`, its per-request `RequestRecord`); its `close` writes what is pending.

There is one admission: `GatedAdmission` (gateway/admission/gates.py) as `build_admission`
(gateway/admission/settings.py) assembles it, for `loraplex serve` and for the tests alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.concurrency import run_in_threadpool

from gateway.store import RequestRecord, Store, Tenant
from policies import FairQueue

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdmissionRequest:
    request_id: str
    tenant: Tenant
    model: str
    requested_priority: int | None
    prompt_tokens: int
    max_tokens: int  # per sample
    n: int

    @property
    def reserved_tokens(self) -> int:
        """What admission reserves: the prompt plus every sample's max_tokens."""
        return self.prompt_tokens + self.max_tokens * self.n


@dataclass(frozen=True)
class Admitted:
    priority: int
    headers: dict[str, str]  # e.g. x-ratelimit-* to send with the response
    handle: Any = None  # what the admission needs back at release (its gates' passes)
    queue_wait_s: float | None = None  # seconds the grant waited in the fair queue; None without a queue


@dataclass(frozen=True)
class FinalUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    outcome: str  # "ok" | "error" | "disconnected"
    finish_reasons: tuple[str | None, ...] = ()  # one per choice, as answered; None where it did not finish


@dataclass(frozen=True)
class RequestLabels:
    """Who sent a request and what it carried (OpenAI's `user`, `safety_identifier`, `metadata`, checked at
    the edge), known when it starts; with its FinalUsage it is the request's RequestRecord."""

    request_id: str
    key_id: str
    model: str  # the name the request asked for
    adapter: str | None  # the adapter version served (name@version); None: the base model
    created_at: float
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] = field(default_factory=dict, hash=False)

    def record(self, tenant_id: str, usage: FinalUsage) -> RequestRecord:
        return RequestRecord(self.request_id, tenant_id, self.key_id, self.model, self.adapter, self.created_at,
                             usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens, usage.finish_reasons,
                             usage.outcome, self.user, self.safety_identifier, dict(self.metadata))


class RequestAdmission(Protocol):
    @property
    def queue(self) -> FairQueue | None: ...

    async def admit(self, request: AdmissionRequest) -> Admitted: ...

    async def release(self, request: AdmissionRequest, admitted: Admitted, usage: FinalUsage) -> None: ...

    def stats(self) -> dict[str, Any]:
        """Counters since start (grants, refusals by reason, queue and quota-store state)."""
        ...

    async def close(self) -> None: ...


class UsageReporter(Protocol):
    async def report(self, tenant: Tenant, usage: FinalUsage, labels: RequestLabels | None = None) -> None: ...

    async def close(self) -> None: ...


class StoreUsageReporter:
    """Adds each finished request to the tenant's hourly usage counters in the store, and its record (two
    writes each; `loraplex serve` batches them: gateway/admission/usage.py)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def report(self, tenant: Tenant, usage: FinalUsage, labels: RequestLabels | None = None) -> None:
        try:
            await run_in_threadpool(
                self.store.record_usage, tenant.id, None, 1, usage.prompt_tokens, usage.completion_tokens,
                usage.cached_tokens,
            )
            if labels is not None:
                await run_in_threadpool(self.store.record_requests, tenant.id, [labels.record(tenant.id, usage)])
        except Exception:  # usage must never turn a served request into an error
            log.exception("could not record usage for tenant %s", tenant.id)

    async def close(self) -> None:
        """Nothing is pending: every report was written when it was made."""
