"""`GatedAdmission`: the gateway's RequestAdmission, made of admission gates passed in order.

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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from gateway.admission.base import AdmissionRequest, Admitted, FinalUsage
from gateway.http.errors import ApiError
from policies import FairQueue, PriorityNotAllowed


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
