"""Admission gates: `GatedAdmission` (the gateway's RequestAdmission, gates passed in order), `QuotaGate`,
`FairQueueGate`.

admit(request):
    priority  request.tenant.policy.resolve_priority(requested) — the one priority rule (lower number =
              served first; outside [min_priority, max_priority] → 400 priority_not_allowed, never clamped).
    gates     each gate's enter(request, priority), in the order given to the constructor. A gate refuses
              by raising Refusal (an ApiError tallied under `reason`), holding nothing. When gate k
              refuses, or the admission is cancelled (the client left while queued), the gates already
              passed are left in reverse order with 0 tokens served (nothing ran), and a refusal also
              carries their `refund_headers` (e.g. the x-ratelimit-* state once the quota was given back)
              under its own headers.
    grant     Admitted(priority, every gate's headers, handle=_Grant, queue_wait_s from the gates).
release(request, admitted, usage): leaves every passed gate once, in reverse order, with prompt +
    completion tokens served. A second call is a no-op.
close(): closes every gate, last one first (connections, background renewals).

The gates `loraplex serve` runs (gateway/admission/settings.py): QuotaGate (rate limits, budgets and the
concurrency lease, one atomic quota-backend call), then FairQueueGate (priority + weighted fair queue).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from gateway.admission.base import AdmissionRequest, Admitted, FinalUsage
from gateway.http.errors import ApiError
from policies import (
    Admission,
    FairQueue,
    Lease,
    PriorityNotAllowed,
    QueueFull,
    QueueTimeout,
    QuotaBackend,
    QuotaUnavailable,
    RequestTooLarge,
    Ticket,
    admission_headers,
)
from policies.headers import rate_limit_headers, retry_after_headers

log = logging.getLogger(__name__)


class Refusal(ApiError):
    """A gate's refusal: the OpenAI-shaped error, plus the `reason` it is counted under in stats()."""

    def __init__(self, reason: str, status: int, message: str, **kwargs: Any) -> None:
        super().__init__(status, message, **kwargs)
        self.reason = reason


@dataclass(frozen=True)
class GatePass:
    """What one gate handed a granted request, and holds for it until leave()."""

    headers: Mapping[str, str] = field(default_factory=dict)  # sent with the response
    refund_headers: Mapping[str, str] = field(default_factory=dict)  # on a later gate's refusal, instead
    held: Any = None  # the gate's own record (a quota lease, a queue ticket)
    queue_wait_s: float | None = None  # seconds spent waiting in this gate, if it queues


class AdmissionGate(Protocol):
    async def enter(self, request: AdmissionRequest, priority: int) -> GatePass:
        """Take what the request needs from this gate, or raise Refusal having taken nothing."""
        ...

    async def leave(self, passed: GatePass, served_tokens: int) -> None:
        """Give back what enter() took, settling with the tokens actually served. Called once per pass;
        never raises for a store failure (logged: the gate's own record then expires or stays charged)."""
        ...

    def stats(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


@dataclass
class AdmissionCounters:
    """Totals since start (for metrics)."""

    granted: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # by reason: priority, requests, ..., queue_full

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1


@dataclass(eq=False)
class _Grant:
    """The passes one granted request holds until release, in gate order."""

    passes: list[tuple[AdmissionGate, GatePass]]
    released: bool = False


class GatedAdmission:
    def __init__(self, gates: Sequence[AdmissionGate], *, queue: FairQueue | None = None) -> None:
        """`gates` in the order a request passes them; `queue`, the fair queue one of them waits in (what
        the dashboard and /metrics show), or None."""
        self.gates = tuple(gates)
        self._queue = queue
        self.counters = AdmissionCounters()

    @property
    def queue(self) -> FairQueue | None:
        return self._queue

    async def admit(self, request: AdmissionRequest) -> Admitted:
        try:
            priority = request.tenant.policy.resolve_priority(request.requested_priority)
        except PriorityNotAllowed as e:
            self.counters.refuse("priority")
            raise ApiError(400, str(e), param="priority", code="priority_not_allowed") from None
        passes: list[tuple[AdmissionGate, GatePass]] = []
        try:
            for gate in self.gates:
                passes.append((gate, await gate.enter(request, priority)))
        except Refusal as refusal:
            await self._leave(passes, served_tokens=0)
            for _, passed in passes:
                refusal.headers = {**passed.refund_headers, **refusal.headers}
            self.counters.refuse(refusal.reason)
            raise
        except BaseException:  # cancelled while queued, or a gate failed: nothing ran
            with anyio.CancelScope(shield=True):
                await self._leave(passes, served_tokens=0)
            raise
        self.counters.granted += 1
        headers: dict[str, str] = {}
        for _, passed in passes:
            headers.update(passed.headers)
        waits = [p.queue_wait_s for _, p in passes if p.queue_wait_s is not None]
        return Admitted(priority=priority, headers=headers, handle=_Grant(passes),
                        queue_wait_s=sum(waits) if waits else None)

    async def release(self, request: AdmissionRequest, admitted: Admitted, usage: FinalUsage) -> None:
        grant = admitted.handle
        if not isinstance(grant, _Grant):
            raise TypeError(f"release() needs an Admitted from this admission, got handle {grant!r}")
        if grant.released:
            return
        grant.released = True
        await self._leave(grant.passes, usage.prompt_tokens + usage.completion_tokens)

    def stats(self) -> dict[str, Any]:
        """Grants, refusals by reason, and each gate's own counters (queue depth, quota-store state)."""
        out: dict[str, Any] = {"granted": self.counters.granted, "refused": dict(self.counters.refused)}
        for gate in self.gates:
            out.update(gate.stats())
        return out

    async def close(self) -> None:
        for gate in reversed(self.gates):
            await gate.close()

    @staticmethod
    async def _leave(passes: list[tuple[AdmissionGate, GatePass]], served_tokens: int) -> None:
        for gate, passed in reversed(passes):
            await gate.leave(passed, served_tokens)



@dataclass(frozen=True)
class _Held:
    lease: Lease
    renewal: asyncio.Task


class QuotaGate:
    """`QuotaGate`: rate limits, token budgets and the concurrency lease of a request (any QuotaBackend).

    enter(request, priority):
        quota.admit(tenant, tenant.policy, prompt_tokens, max_tokens * n), one atomic call: RequestTooLarge →
        400 request_too_large; QuotaUnavailable (Redis down, fail-closed) → 503 quota_unavailable; refused →
        429 with x-ratelimit-*, retry-after, retry-after-ms and code rate_limit_exceeded / insufficient_quota.
        On a grant a renewal task extends the lease every ttl / 3 until leave() (queue waits included). The
        pass's refund_headers are the x-ratelimit-* state once the reservation is given back.
    leave(pass, served): stop renewing, reconcile the reservation with the tokens served, release the lease.

    NOTE: concurrency is not a gate of its own: across replicas the lease must be taken in the same atomic
    step as the buckets and budgets (a lease refused after taking tokens would have to refund them).
    If the process dies, its leases stop being renewed and expire after the lease ttl; reservations stay
    charged (never under-counted).
    """

    def __init__(self, quota: QuotaBackend) -> None:
        self.quota = quota
        self._renewals: set[asyncio.Task] = set()

    async def enter(self, request: AdmissionRequest, priority: int) -> GatePass:
        admission = await self._admit(request)
        lease = admission.lease
        assert lease is not None
        return GatePass(headers=admission_headers(admission), refund_headers=_refunded(admission),
                        held=_Held(lease, self._start_renewal(lease)))

    async def leave(self, passed: GatePass, served_tokens: int) -> None:
        held: _Held = passed.held
        held.renewal.cancel()
        try:
            await self.quota.reconcile(held.lease, served_tokens)
        except Exception:
            log.exception("reconciling lease %s failed; its reservation stays charged", held.lease.lease_id)
        try:
            await self.quota.release(held.lease)
        except Exception:
            log.exception("releasing lease %s failed; it expires after %.0fs", held.lease.lease_id,
                          held.lease.ttl_s)

    def stats(self) -> dict[str, Any]:
        return {f"quota_{name}": value for name, value in self.quota.stats().items()}

    async def close(self) -> None:
        """Stop renewing leases and close the quota backend's connections."""
        for task in list(self._renewals):
            task.cancel()
        await self.quota.close()

    async def _admit(self, request: AdmissionRequest) -> Admission:
        tenant = request.tenant
        try:
            admission = await self.quota.admit(tenant.id, tenant.policy, request.prompt_tokens,
                                               request.max_tokens * request.n)
        except RequestTooLarge as e:
            raise Refusal("too_large", 400, str(e), param="max_tokens", code="request_too_large") from None
        except QuotaUnavailable as e:
            raise Refusal("quota_unavailable", 503, f"Rate limits cannot be checked right now ({e}). Please retry.",
                          code="quota_unavailable", error_type="server_error",
                          headers=retry_after_headers(e.retry_after_s)) from None
        if admission.granted:
            return admission
        assert admission.reason is not None
        code = admission.reason.error_code
        raise Refusal(str(admission.reason), 429, admission.message, code=code,
                      error_type=code if code == "insufficient_quota" else "rate_limit_error",
                      headers=admission_headers(admission))

    def _start_renewal(self, lease: Lease) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(self._renew_until_released(lease),
                                                      name=f"lease-renewal-{lease.lease_id}")
        self._renewals.add(task)
        task.add_done_callback(self._renewals.discard)
        return task

    async def _renew_until_released(self, lease: Lease) -> None:
        """Every ttl / 3. A failed renewal (store briefly down) is logged and retried on the next tick."""
        interval = lease.ttl_s / 3
        warned = False
        while True:
            await asyncio.sleep(interval)
            try:
                renewed = await self.quota.renew(lease)
            except Exception as e:  # never let a renewal error escape into the loop's handler
                renewed = False
                log.debug("lease %s renewal raised %s", lease.lease_id, e)
            if not renewed and not warned:
                warned = True
                log.warning("lease %s of tenant %s could not be renewed (expired, or the quota store is "
                            "unreachable); the concurrency limit may admit another request", lease.lease_id,
                            lease.tenant_id)


def _refunded(admission: Admission) -> dict[str, str]:
    """The x-ratelimit-* headers once this grant's reservation is given back (for a later gate's refusal)."""
    snapshot = admission.snapshot
    reserved = admission.lease.reserved_tokens if admission.lease else 0
    headers = rate_limit_headers(snapshot)
    headers["x-ratelimit-remaining-tokens"] = str(min(snapshot.limit_tokens, snapshot.remaining_tokens + reserved))
    return headers


class FairQueueGate:
    """`FairQueueGate`: a request waits for a worker slot in the priority + weighted fair queue.

    enter(request, priority): queue.acquire(tenant, priority, tenant.policy.fair_share_weight,
        cost=request.reserved_tokens, timeout, max_queued=tenant.policy.max_queued_requests). QueueFull of the
        tenant → 429 rate_limit_exceeded, of the whole gateway → 503, QueueTimeout → 503, each with
        retry-after. A cancelled wait leaves the queue (policies.FairQueue's own contract).
    leave(pass, served): frees the slot, charging the tenant's fair share the tokens actually served.
    Not thread-safe, like the queue: one event loop.
    """

    def __init__(self, queue: FairQueue, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"queue timeout_s must be > 0, got {timeout_s}")
        self.queue = queue
        self.timeout_s = timeout_s

    async def enter(self, request: AdmissionRequest, priority: int) -> GatePass:
        policy = request.tenant.policy
        try:
            ticket = await self.queue.acquire(request.tenant.id, priority, policy.fair_share_weight,
                                              request.reserved_tokens, timeout=self.timeout_s,
                                              max_queued=policy.max_queued_requests)
        except QueueFull as e:
            if e.scope == "tenant":
                raise Refusal("queue_full_tenant", 429, f"Too many queued requests: {e}. Please retry later.",
                              code="rate_limit_exceeded", error_type="rate_limit_error",
                              headers=retry_after_headers(e.retry_after_s)) from None
            raise _overloaded("queue_full", e, e.retry_after_s) from None
        except QueueTimeout as e:
            raise _overloaded("queue_timeout", e, e.retry_after_s) from None
        return GatePass(held=ticket, queue_wait_s=ticket.waited_s)

    async def leave(self, passed: GatePass, served_tokens: int) -> None:
        ticket: Ticket = passed.held
        self.queue.release(ticket, actual_cost=served_tokens)

    def stats(self) -> dict[str, Any]:
        return {"queue_waiting": self.queue.waiting, "queue_in_flight": self.queue.in_flight,
                "queue_capacity": self.queue.capacity, "queue_depth_by_priority": self.queue.depth_by_priority()}

    async def close(self) -> None:
        """Holds no connections; waiters still queued at shutdown time out or are cancelled with their request."""


def _overloaded(reason: str, error: Exception, retry_after_s: float) -> Refusal:
    return Refusal(reason, 503, f"The gateway is overloaded: {error}. Please retry later.",
                   code="service_unavailable", error_type="server_error", headers=retry_after_headers(retry_after_s))
