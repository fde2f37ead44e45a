"""`FairQueueGate`: a request waits for a worker slot in the priority + weighted fair queue.

enter(request, priority): queue.acquire(tenant, priority, tenant.policy.fair_share_weight,
    cost=request.reserved_tokens, timeout, max_queued=tenant.policy.max_queued_requests). QueueFull of the
    tenant → 429 rate_limit_exceeded, of the whole gateway → 503, QueueTimeout → 503, each with
    retry-after. A cancelled wait leaves the queue (policies.FairQueue's own contract).
leave(pass, served): frees the slot, charging the tenant's fair share the tokens actually served.
Not thread-safe, like the queue: one event loop.
"""

from __future__ import annotations

from typing import Any

from gateway.admission.base import AdmissionRequest
from gateway.admission.gates import GatePass, Refusal
from policies import FairQueue, QueueFull, QueueTimeout, Ticket
from policies.headers import retry_after_headers


class FairQueueGate:
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
