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

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from gateway.admission.base import AdmissionRequest
from gateway.admission.gates import GatePass, Refusal
from policies import Admission, Lease, QuotaBackend, QuotaUnavailable, RequestTooLarge, admission_headers
from policies.headers import rate_limit_headers, retry_after_headers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Held:
    lease: Lease
    renewal: asyncio.Task


class QuotaGate:
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
