"""`QuotaAdmission`: the gateway's RequestAdmission over the policies package.

admit(request), in order:
    policy    Tenant.policy validated as policies.TenantPolicy (an invalid stored policy → the defaults,
              logged once per distinct policy).
    priority  policy.resolve_priority(requested): outside [min_priority, max_priority] → 400
              priority_not_allowed (refused, never clamped).
    quota     quota.admit(tenant, policy, prompt_tokens, max_tokens * n): RequestTooLarge → 400
              request_too_large; QuotaUnavailable (Redis down, fail-closed) → 503; refused → 429 with
              x-ratelimit-*, retry-after, retry-after-ms and code rate_limit_exceeded / insufficient_quota.
    lease     a renewal task extends the lease every ttl / 3 from here until release (queue waits included).
    queue     queue.acquire(tenant, priority, weight, cost=reservation): QueueFull of the tenant → 429, of
              the whole gateway → 503, QueueTimeout → 503, each with retry-after; the quota is then given
              back (tokens refunded, lease released) because nothing ran.
    grant     Admitted(priority, x-ratelimit-* headers, handle=_Grant(lease, ticket)).
release(request, admitted, usage) settles a grant exactly once, whatever the outcome: stop renewing,
    free the queue slot (charging the fair queue the tokens actually served), reconcile the quota with
    prompt + completion tokens, release the lease. A second call is a no-op.

If the process dies, its leases stop being renewed and expire after the lease ttl; reservations stay
charged (never under-counted).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import anyio

from gateway.admission.base import AdmissionRequest, Admitted, FinalUsage
from gateway.http.errors import ApiError
from gateway.store import Tenant
from policies import (
    Admission,
    FailoverQuotaBackend,
    FairQueue,
    Lease,
    PriorityNotAllowed,
    QueueFull,
    QueueTimeout,
    QuotaBackend,
    QuotaUnavailable,
    RequestTooLarge,
    TenantPolicy,
    Ticket,
    admission_headers,
    retry_after_headers,
)
from policies.headers import rate_limit_headers

log = logging.getLogger(__name__)


class TenantPolicies:
    """Tenant.policy (opaque JSON in the store) → TenantPolicy, parsed once per distinct JSON."""

    MAX_CACHED = 4096

    def __init__(self, default: TenantPolicy | None = None) -> None:
        self.default = default or TenantPolicy()
        self._parsed: dict[str, TenantPolicy] = {}

    def policy_for(self, tenant: Tenant) -> TenantPolicy:
        """The tenant's policy; the default when the stored one is invalid (logged once per JSON text).

        Fields the stored policy leaves out take the default's values, except that a default_priority
        outside a stored [min_priority, max_priority] is moved to the nearest end of that range and a
        default max_tokens_per_request above a stored tokens_per_minute is lowered to it (so
        `{"max_priority": 4}` or `{"tokens_per_minute": 300}` alone is a valid policy).
        """
        text = json.dumps(tenant.policy, sort_keys=True, separators=(",", ":"))
        policy = self._parsed.get(text)
        if policy is None:
            try:
                fields = {**self.default.model_dump(), **tenant.policy}
                if "default_priority" not in tenant.policy and isinstance(fields["min_priority"], int) \
                        and isinstance(fields["max_priority"], int):
                    fields["default_priority"] = min(max(fields["default_priority"], fields["min_priority"]),
                                                     fields["max_priority"])
                if "max_tokens_per_request" not in tenant.policy and isinstance(fields["tokens_per_minute"], int):
                    fields["max_tokens_per_request"] = min(fields["max_tokens_per_request"],
                                                           fields["tokens_per_minute"])
                policy = TenantPolicy.model_validate(fields)
            except ValueError as e:
                log.error("tenant %s (%s) has an invalid policy %s; using the default limits: %s",
                          tenant.name, tenant.id, text, e)
                policy = self.default
            if len(self._parsed) >= self.MAX_CACHED:
                self._parsed.clear()
            self._parsed[text] = policy
        return policy


@dataclass(eq=False)
class _Grant:
    """What one granted request holds until release."""

    lease: Lease
    ticket: Ticket | None = None
    renewal: asyncio.Task | None = None
    released: bool = False


@dataclass
class AdmissionCounters:
    """Totals since start (for metrics)."""

    granted: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # by reason: requests, tokens, ..., queue_full

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1


class QuotaAdmission:
    """RequestAdmission with per-tenant quotas (any QuotaBackend) and the weighted fair queue."""

    def __init__(self, quota: QuotaBackend, queue: FairQueue, *, queue_timeout_s: float = 30.0,
                 policies: TenantPolicies | None = None) -> None:
        if queue_timeout_s <= 0:
            raise ValueError(f"queue_timeout_s must be > 0, got {queue_timeout_s}")
        self.quota = quota
        self.queue = queue
        self.queue_timeout_s = queue_timeout_s
        self.policies = policies or TenantPolicies()
        self.counters = AdmissionCounters()
        self._renewals: set[asyncio.Task] = set()

    async def admit(self, request: AdmissionRequest) -> Admitted:
        policy = self.policies.policy_for(request.tenant)
        try:
            priority = policy.resolve_priority(request.requested_priority)
        except PriorityNotAllowed as e:
            self.counters.refuse("priority")
            raise ApiError(400, str(e), param="priority", code="priority_not_allowed") from None
        admission = await self._admit_quota(request, policy)
        assert admission.lease is not None
        grant = _Grant(admission.lease)
        grant.renewal = self._start_renewal(grant.lease)
        try:
            grant.ticket = await self.queue.acquire(
                request.tenant.id, priority, policy.fair_share_weight, admission.lease.reserved_tokens,
                timeout=self.queue_timeout_s, max_queued=policy.max_queued_requests)
        except (QueueFull, QueueTimeout) as e:
            await self._settle(grant, actual_tokens=0)
            raise self._queue_error(e, admission) from None
        except BaseException:  # cancelled while queued: nothing ran
            with anyio.CancelScope(shield=True):
                await self._settle(grant, actual_tokens=0)
            raise
        self.counters.granted += 1
        return Admitted(priority=priority, headers=admission_headers(admission), handle=grant)

    async def release(self, request: AdmissionRequest, admitted: Admitted, usage: FinalUsage) -> None:
        grant = admitted.handle
        if not isinstance(grant, _Grant):
            raise TypeError(f"release() needs an Admitted from this admission, got handle {grant!r}")
        await self._settle(grant, usage.prompt_tokens + usage.completion_tokens)

    async def close(self) -> None:
        """Stop renewing leases and close the quota backend's connections."""
        for task in list(self._renewals):
            task.cancel()
        await self.quota.close()

    def stats(self) -> dict[str, Any]:
        """Counters for metrics: grants, refusals by reason, queue depth, and failover counters."""
        out: dict[str, Any] = {
            "granted": self.counters.granted, "refused": dict(self.counters.refused),
            "queue_waiting": self.queue.waiting, "queue_in_flight": self.queue.in_flight,
            "queue_capacity": self.queue.capacity, "queue_depth_by_priority": self.queue.depth_by_priority(),
        }
        if isinstance(self.quota, FailoverQuotaBackend):
            out.update(quota_degraded=self.quota.degraded, quota_outages=self.quota.outages,
                       quota_fallback_admissions=self.quota.fallback_admissions,
                       quota_refused_unavailable=self.quota.refused_unavailable,
                       quota_lost_updates=self.quota.lost_updates)
        return out

    # --- internals -----------------------------------------------------------------------------------
    async def _admit_quota(self, request: AdmissionRequest, policy: TenantPolicy) -> Admission:
        try:
            admission = await self.quota.admit(request.tenant.id, policy, request.prompt_tokens,
                                               request.max_tokens * request.n)
        except RequestTooLarge as e:
            self.counters.refuse("too_large")
            raise ApiError(400, str(e), param="max_tokens", code="request_too_large") from None
        except QuotaUnavailable as e:
            self.counters.refuse("quota_unavailable")
            raise ApiError(503, f"Rate limits cannot be checked right now ({e}). Please retry.",
                           code="quota_unavailable", error_type="server_error",
                           headers=retry_after_headers(e.retry_after_s)) from None
        if admission.granted:
            return admission
        assert admission.reason is not None
        self.counters.refuse(str(admission.reason))
        code = admission.reason.error_code
        error_type = code if code == "insufficient_quota" else "rate_limit_error"
        raise ApiError(429, admission.message, code=code, error_type=error_type,
                       headers=admission_headers(admission))

    def _queue_error(self, error: QueueFull | QueueTimeout, admission: Admission) -> ApiError:
        # The reservation was refunded: report the bucket as it is now, not as it was mid-admission.
        snapshot = admission.snapshot
        refunded = min(snapshot.limit_tokens, snapshot.remaining_tokens + (admission.lease.reserved_tokens
                                                                           if admission.lease else 0))
        headers = rate_limit_headers(snapshot)
        headers["x-ratelimit-remaining-tokens"] = str(refunded)
        headers.update(retry_after_headers(error.retry_after_s))
        if isinstance(error, QueueFull) and error.scope == "tenant":
            self.counters.refuse("queue_full_tenant")
            return ApiError(429, f"Too many queued requests: {error}. Please retry later.",
                            code="rate_limit_exceeded", error_type="rate_limit_error", headers=headers)
        self.counters.refuse("queue_full" if isinstance(error, QueueFull) else "queue_timeout")
        return ApiError(503, f"The gateway is overloaded: {error}. Please retry later.",
                        code="service_unavailable", error_type="server_error", headers=headers)

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

    async def _settle(self, grant: _Grant, actual_tokens: int) -> None:
        """Give back everything `grant` holds, once. Never raises for store failures (logged)."""
        if grant.released:
            return
        grant.released = True
        if grant.renewal is not None:
            grant.renewal.cancel()
        if grant.ticket is not None:
            self.queue.release(grant.ticket, actual_cost=actual_tokens)
        try:
            await self.quota.reconcile(grant.lease, actual_tokens)
        except Exception:
            log.exception("reconciling lease %s failed; its reservation stays charged", grant.lease.lease_id)
        try:
            await self.quota.release(grant.lease)
        except Exception:
            log.exception("releasing lease %s failed; it expires after %.0fs", grant.lease.lease_id,
                          grant.lease.ttl_s)

