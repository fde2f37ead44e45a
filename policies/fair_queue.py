"""Gateway-side admission queue: strict priority, then deficit round robin across tenants by weight.

Semantics:
    capacity    worker slots; a ticket holds one from acquire() until release(). set_capacity() any time.
    order       When a slot frees, the waiter chosen is from the lowest priority number that has waiters
                (vLLM: lower = sooner; lower levels starve higher ones by design). Within one level, tenants
                with waiters form a ring served by deficit round robin: when a tenant's turn starts its
                deficit grows by quantum_tokens * weight; it is served, oldest request first, while its
                deficit covers the head request's cost_estimate; then the turn passes. A tenant whose last
                waiter leaves drops out of the ring and its deficit resets to 0 (no banked credit).
    cost        cost_estimate is charged when a queued request is granted; release(ticket, actual_cost)
                refunds estimate - actual (or charges the overrun) to the tenant's deficit if the tenant
                still has waiters at that level, so shares converge on tokens actually served.
    fast path   A request arriving when a slot is free and nobody waits is granted at once, uncharged.
    bounds      per tenant (all levels together) and in total: QueueFull (scope "tenant" → 429,
                scope "total" → 503, both with retry-after).
    timeout     a waiter not granted within `timeout` seconds gets QueueTimeout (→ 503 + retry-after).
    cancel      a cancelled acquire leaves the queue; if its ticket was granted in the same instant it is
                released at once, so cancellation never leaks a slot.
Not thread-safe: use from one event loop.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field


class QueueFull(Exception):
    def __init__(self, message: str, scope: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.scope = scope  # "tenant" or "total"
        self.retry_after_s = retry_after_s


class QueueTimeout(Exception):
    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class FairQueueConfig:
    capacity: int = 1
    max_total_queued: int = 1024
    max_queued_per_tenant: int = 64  # used when acquire() is given no max_queued
    quantum_tokens: int = 1024  # deficit added per turn at weight 1.0
    default_timeout_s: float = 30.0
    min_retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("capacity", "max_total_queued", "max_queued_per_tenant"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.quantum_tokens < 1:
            raise ValueError(f"quantum_tokens must be >= 1, got {self.quantum_tokens}")
        if self.default_timeout_s <= 0 or self.min_retry_after_s <= 0:
            raise ValueError("default_timeout_s and min_retry_after_s must be > 0")


@dataclass(frozen=True)
class Ticket:
    ticket_id: int
    tenant: str
    priority: int
    cost_estimate: int
    waited_s: float


@dataclass(eq=False)
class _Waiter:
    tenant: str
    priority: int
    cost: int
    future: asyncio.Future
    enqueued_at: float


@dataclass
class _Lane:
    weight: float
    waiters: deque[_Waiter] = field(default_factory=deque)
    deficit: float = 0.0


@dataclass
class _Level:
    lanes: dict[str, _Lane] = field(default_factory=dict)
    ring: deque[str] = field(default_factory=deque)  # tenants with waiters; ring[0] has the turn
    head_credited: bool = False  # ring[0] already got its quantum for this turn


class FairQueue:
    def __init__(self, config: FairQueueConfig | None = None) -> None:
        self.config = config or FairQueueConfig()
        self._capacity = self.config.capacity
        self._levels: dict[int, _Level] = {}
        self._granted: dict[int, tuple[Ticket, bool, float]] = {}  # id -> (ticket, charged, granted_at)
        self._ids = itertools.count(1)
        self._waiting_by_tenant: dict[str, int] = {}
        self._service_s_avg = 0.0  # moving average of slot hold time, for retry-after hints

    # --- metrics -------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def in_flight(self) -> int:
        return len(self._granted)

    @property
    def waiting(self) -> int:
        return sum(self._waiting_by_tenant.values())

    def depth_by_priority(self) -> dict[int, int]:
        return {p: sum(len(lane.waiters) for lane in lvl.lanes.values()) for p, lvl in sorted(self._levels.items())}

    def depth_by_tenant(self) -> dict[str, int]:
        return dict(self._waiting_by_tenant)

    # --- public operations ---------------------------------------------------------------------------
    def set_capacity(self, capacity: int) -> None:
        """Change worker slots; extra slots are handed to waiters now. Fewer slots never revoke tickets."""
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._capacity = capacity
        self._dispatch()

    async def acquire(self, tenant: str, priority: int, weight: float = 1.0, cost_estimate: int = 1,
                      timeout: float | None = None, max_queued: int | None = None) -> Ticket:
        """Wait for a slot. Raises QueueFull at once when bounds are hit, QueueTimeout after `timeout`."""
        if weight <= 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        if cost_estimate < 0:
            raise ValueError(f"cost_estimate must be >= 0, got {cost_estimate}")
        timeout = self.config.default_timeout_s if timeout is None else timeout
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        loop = asyncio.get_running_loop()
        if self.waiting == 0 and self.in_flight < self._capacity:
            return self._grant(tenant, priority, cost_estimate, charged=False, waited_s=0.0)
        tenant_limit = self.config.max_queued_per_tenant if max_queued is None else max_queued
        if self._waiting_by_tenant.get(tenant, 0) >= tenant_limit:
            raise QueueFull(f"tenant {tenant!r} already has {tenant_limit} queued requests (its limit)",
                            "tenant", self._retry_after_hint())
        if self.waiting >= self.config.max_total_queued:
            raise QueueFull(f"the gateway queue is full ({self.config.max_total_queued} requests)",
                            "total", self._retry_after_hint())
        waiter = _Waiter(tenant, priority, cost_estimate, loop.create_future(), loop.time())
        self._enqueue(waiter, weight)
        timer = loop.call_later(timeout, self._expire, waiter, timeout)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.cancelled() or not waiter.future.done():
                self._remove(waiter)
            elif waiter.future.exception() is None:
                self.release(waiter.future.result(), actual_cost=0)  # granted as we were cancelled
            raise
        finally:
            timer.cancel()

    def release(self, ticket: Ticket, actual_cost: int | None = None) -> bool:
        """Free the ticket's slot and settle its cost. Idempotent: False if already released."""
        entry = self._granted.pop(ticket.ticket_id, None)
        if entry is None:
            return False
        _, charged, granted_at = entry
        held = asyncio.get_running_loop().time() - granted_at
        self._service_s_avg = 0.9 * self._service_s_avg + 0.1 * held if self._service_s_avg else held
        if charged and actual_cost is not None:
            level = self._levels.get(ticket.priority)
            lane = None if level is None else level.lanes.get(ticket.tenant)
            if lane is not None:
                lane.deficit += ticket.cost_estimate - actual_cost
        self._dispatch()
        return True

    # --- internals -----------------------------------------------------------------------------------
    def _grant(self, tenant: str, priority: int, cost: int, charged: bool, waited_s: float) -> Ticket:
        ticket = Ticket(next(self._ids), tenant, priority, cost, waited_s)
        self._granted[ticket.ticket_id] = (ticket, charged, asyncio.get_running_loop().time())
        return ticket

    def _enqueue(self, waiter: _Waiter, weight: float) -> None:
        level = self._levels.setdefault(waiter.priority, _Level())
        lane = level.lanes.get(waiter.tenant)
        if lane is None:
            lane = level.lanes[waiter.tenant] = _Lane(weight)
            level.ring.append(waiter.tenant)
        lane.weight = weight
        lane.waiters.append(waiter)
        self._waiting_by_tenant[waiter.tenant] = self._waiting_by_tenant.get(waiter.tenant, 0) + 1

    def _remove(self, waiter: _Waiter) -> None:
        """Take a waiter that will never be granted out of its lane (timeout or cancellation)."""
        level = self._levels.get(waiter.priority)
        lane = None if level is None else level.lanes.get(waiter.tenant)
        if level is None or lane is None or waiter not in lane.waiters:
            return
        lane.waiters.remove(waiter)
        self._forget(level, waiter)

    def _forget(self, level: _Level, waiter: _Waiter) -> None:
        count = self._waiting_by_tenant[waiter.tenant] - 1
        if count:
            self._waiting_by_tenant[waiter.tenant] = count
        else:
            del self._waiting_by_tenant[waiter.tenant]
        if level.lanes[waiter.tenant].waiters:
            return
        del level.lanes[waiter.tenant]
        if level.ring[0] == waiter.tenant:
            level.head_credited = False
        level.ring.remove(waiter.tenant)
        if not level.ring:
            del self._levels[waiter.priority]

    def _expire(self, waiter: _Waiter, timeout: float) -> None:
        if waiter.future.done():
            return
        self._remove(waiter)
        waiter.future.set_exception(QueueTimeout(
            f"request waited {timeout:.3f}s in the gateway queue without a free worker slot",
            self._retry_after_hint()))

    def _pop_next(self) -> _Waiter | None:
        if not self._levels:
            return None
        level = self._levels[min(self._levels)]
        while True:  # terminates: each pass without a grant adds a positive quantum to some deficit
            tenant = level.ring[0]
            lane = level.lanes[tenant]
            if not level.head_credited:
                lane.deficit += self.config.quantum_tokens * lane.weight
                level.head_credited = True
            head = lane.waiters[0]
            if lane.deficit >= head.cost:
                lane.deficit -= head.cost
                lane.waiters.popleft()
                self._forget(level, head)
                return head
            level.ring.rotate(-1)
            level.head_credited = False

    def _dispatch(self) -> None:
        while self.in_flight < self._capacity:
            waiter = self._pop_next()
            if waiter is None:
                return
            if waiter.future.done():  # cancelled; its task has not yet run the cleanup in acquire()
                continue
            loop = asyncio.get_running_loop()
            ticket = self._grant(waiter.tenant, waiter.priority, waiter.cost, charged=True,
                                 waited_s=loop.time() - waiter.enqueued_at)
            waiter.future.set_result(ticket)

    def _retry_after_hint(self) -> float:
        slots = max(1, self._capacity)
        return max(self.config.min_retry_after_s, self._service_s_avg * (self.waiting + 1) / slots)
