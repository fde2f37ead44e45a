"""In-process QuotaBackend: the embedded default (one gateway) and the fail-open fallback of a replica.

Each decision (check and take) runs to completion without awaiting, so on one event loop it is atomic; no
lock is needed. Buckets and leases are in memory only (a restarted gateway starts with full buckets and no
leases). Budget counters go through an optional UsageLedger (policies.usage_ledger) so they survive a restart:

    budgeted tenant    (a daily or monthly budget in the policy of its latest admission) every booking is
                       queued to a GroupCommitLedger right after the decision, and admit / reconcile return
                       only once it is committed. Concurrent requests share one transaction (one fsync) and
                       the event loop never waits on the disk. If the commit fails, admit takes its grant
                       back and raises QuotaUnavailable (503); a waiter cancelled meanwhile gives its grant
                       back once the commit's outcome is known.
    no budget          bookings are counted in memory only (usage() still reports them) and carried into the
                       ledger with the tenant's first booking after a budget appears, so a budget set later in
                       a period still counts the whole period, unless the gateway restarted in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from policies.ledger_writer import GroupCommitLedger, LedgerWriteFailed
from policies.quota import (
    Admission,
    BudgetPeriods,
    Lease,
    QuotaBackend,
    QuotaConfig,
    QuotaUnavailable,
    RateLimitSnapshot,
    TenantUsage,
    TokenBucket,
    choose_refusal,
    refusal_message,
)
from policies.tenant_policy import TenantPolicy
from policies.usage_ledger import UsageLedger


@dataclass
class _TenantState:
    requests: TokenBucket
    tokens: TokenBucket
    lease_expiry: dict[str, float] = field(default_factory=dict)  # lease id -> unix expiry
    unsettled: set[str] = field(default_factory=set)  # lease ids not yet reconciled
    budgeted: bool = False  # the latest admission's policy has a budget: bookings must be durable


class MemoryQuotaBackend(QuotaBackend):
    def __init__(self, config: QuotaConfig | None = None, ledger: UsageLedger | None = None,
                 clock: Callable[[], float] = time.time, origin: str = "primary") -> None:
        self.config = config or QuotaConfig()
        self._ledger = GroupCommitLedger(ledger) if ledger is not None else None
        self._clock = clock
        self._origin = origin
        self._tenants: dict[str, _TenantState] = {}
        self._budget_tokens: dict[tuple[str, str], int] = {}  # (tenant, period) -> tokens, ledger cache
        self._unpersisted: dict[tuple[str, str], int] = {}  # tokens booked in memory only (no budget then)

    def _state(self, tenant_id: str, policy: TenantPolicy, now: float) -> _TenantState:
        state = self._tenants.get(tenant_id)
        if state is None:
            state = _TenantState(TokenBucket.full(policy.requests_per_minute, now),
                                 TokenBucket.full(policy.tokens_per_minute, now))
            self._tenants[tenant_id] = state
        state.requests.refill(now, policy.requests_per_minute)
        state.tokens.refill(now, policy.tokens_per_minute)
        for lease_id, expiry in list(state.lease_expiry.items()):
            if expiry <= now:
                del state.lease_expiry[lease_id]
        return state

    def _booked(self, tenant_id: str, period: str) -> int:
        key = (tenant_id, period)
        if key not in self._budget_tokens:
            self._budget_tokens[key] = self._ledger.tokens(tenant_id, period) if self._ledger else 0
        return self._budget_tokens[key]

    def _book(self, tenant_id: str, period: str, delta: int, durable: bool) -> asyncio.Future | None:
        """Book `delta` in memory now; when `durable`, also queue it (with whatever was booked in memory
        only before) to the ledger and return the batch to await. Never awaits."""
        key = (tenant_id, period)
        self._budget_tokens[key] = self._booked(tenant_id, period) + delta  # NOTE: the read comes first
        if self._ledger is None:
            return None
        if not durable:
            self._unpersisted[key] = self._unpersisted.get(key, 0) + delta
            return None
        return self._ledger.queue(tenant_id, period, self._unpersisted.pop(key, 0) + delta)

    async def admit(self, tenant_id: str, policy: TenantPolicy, prompt_tokens: int, max_tokens: int,
                    now: float | None = None) -> Admission:
        reservation = policy.check_request_size(prompt_tokens, max_tokens)
        now = self._clock() if now is None else now
        state = self._state(tenant_id, policy, now)
        periods = BudgetPeriods.at(now)
        day_budget, month_budget = policy.daily_token_budget, policy.monthly_token_budget
        refusal = choose_refusal(
            budget_day_fails=day_budget is not None
            and self._booked(tenant_id, periods.day) + reservation > day_budget,
            budget_month_fails=month_budget is not None
            and self._booked(tenant_id, periods.month) + reservation > month_budget,
            seconds_to_day_end=periods.seconds_to_day_end,
            seconds_to_month_end=periods.seconds_to_month_end,
            requests_wait_s=state.requests.wait_seconds(1),
            tokens_wait_s=state.tokens.wait_seconds(reservation),
            concurrency_full=len(state.lease_expiry) >= policy.max_concurrent_requests,
            concurrency_retry_after_s=self.config.concurrency_retry_after_s,
        )
        if refusal is not None:
            reason, retry_after = refusal
            return Admission(snapshot=self._snapshot(state), reason=reason, retry_after_s=retry_after,
                             message=refusal_message(reason, policy, reservation, retry_after))
        state.requests.take(1)
        state.tokens.take(reservation)
        state.budgeted = day_budget is not None or month_budget is not None
        self._book(tenant_id, periods.day, reservation, state.budgeted)
        batch = self._book(tenant_id, periods.month, reservation, state.budgeted)  # the day's batch too
        lease = Lease(lease_id=uuid.uuid4().hex, tenant_id=tenant_id, reserved_tokens=reservation,
                      tokens_per_minute=policy.tokens_per_minute, day=periods.day, month=periods.month,
                      ttl_s=self.config.lease_ttl_s, origin=self._origin)
        state.lease_expiry[lease.lease_id] = now + self.config.lease_ttl_s
        state.unsettled.add(lease.lease_id)
        admission = Admission(snapshot=self._snapshot(state), lease=lease)
        if batch is not None:
            await self._durable_or_withdrawn(batch, state, lease)
        return admission

    async def _durable_or_withdrawn(self, batch: asyncio.Future, state: _TenantState, lease: Lease) -> None:
        """Wait for the reservation's commit. If it fails, or the caller gives up first, the grant is taken
        back (request, tokens, lease) and, once the commit's outcome is known, the reservation too."""
        try:
            await GroupCommitLedger.durable(batch)
        except BaseException as e:
            state.requests.adjust(1)
            state.tokens.adjust(lease.reserved_tokens)
            state.lease_expiry.pop(lease.lease_id, None)
            state.unsettled.discard(lease.lease_id)
            if batch.done():  # failed (or committed just as the caller gave up)
                self._unbook(lease, committed=_committed(batch))
            else:  # cancelled while the commit runs: take it back once its outcome is known
                batch.add_done_callback(lambda done: self._unbook(lease, committed=_committed(done)))
            if isinstance(e, LedgerWriteFailed):
                raise QuotaUnavailable(str(e), retry_after_s=self.config.concurrency_retry_after_s) from None
            raise

    def _unbook(self, lease: Lease, committed: bool) -> None:
        """Take back a withdrawn reservation: through the ledger if it reached it, else in memory only."""
        for period in (lease.day, lease.month):
            if committed:
                self._book(lease.tenant_id, period, -lease.reserved_tokens, durable=True)
            else:
                key = (lease.tenant_id, period)
                self._budget_tokens[key] = self._booked(lease.tenant_id, period) - lease.reserved_tokens

    @staticmethod
    def _snapshot(state: _TenantState) -> RateLimitSnapshot:
        return RateLimitSnapshot(
            limit_requests=state.requests.capacity, remaining_requests=state.requests.remaining(),
            reset_requests_s=state.requests.reset_seconds(), limit_tokens=state.tokens.capacity,
            remaining_tokens=state.tokens.remaining(), reset_tokens_s=state.tokens.reset_seconds(),
        )

    async def reconcile(self, lease: Lease, actual_total_tokens: int, now: float | None = None) -> bool:
        if actual_total_tokens < 0:
            raise ValueError(f"actual_total_tokens must be >= 0, got {actual_total_tokens}")
        state = self._tenants.get(lease.tenant_id)
        if state is None or lease.lease_id not in state.unsettled:
            return False
        state.unsettled.discard(lease.lease_id)
        now = self._clock() if now is None else now
        refund = lease.reserved_tokens - actual_total_tokens
        state.tokens.refill(now, state.tokens.capacity)
        state.tokens.adjust(refund)
        self._book(lease.tenant_id, lease.day, -refund, state.budgeted)
        batch = self._book(lease.tenant_id, lease.month, -refund, state.budgeted)
        if batch is not None:  # NOTE: awaited so a surcharge is never lost; failures leave an over-count
            with contextlib.suppress(LedgerWriteFailed):  # logged by the writer; the ledger over-counts
                await GroupCommitLedger.durable(batch)
        return True

    async def release(self, lease: Lease) -> bool:
        state = self._tenants.get(lease.tenant_id)
        return state is not None and state.lease_expiry.pop(lease.lease_id, None) is not None

    async def renew(self, lease: Lease, now: float | None = None) -> bool:
        now = self._clock() if now is None else now
        state = self._tenants.get(lease.tenant_id)
        expiry = None if state is None else state.lease_expiry.get(lease.lease_id)
        if state is None or expiry is None or expiry <= now:
            return False
        state.lease_expiry[lease.lease_id] = now + lease.ttl_s
        return True

    async def close(self) -> None:
        """Wait until every queued budget booking is committed."""
        if self._ledger is not None:
            await self._ledger.close()

    async def usage(self, tenant_id: str, now: float | None = None) -> TenantUsage:
        now = self._clock() if now is None else now
        periods = BudgetPeriods.at(now)
        state = self._tenants.get(tenant_id)
        in_flight = 0 if state is None else sum(1 for e in state.lease_expiry.values() if e > now)
        return TenantUsage(tenant_id=tenant_id, day=periods.day, day_tokens=self._booked(tenant_id, periods.day),
                           month=periods.month, month_tokens=self._booked(tenant_id, periods.month),
                           in_flight=in_flight)


def _committed(batch: asyncio.Future) -> bool:
    return not batch.cancelled() and batch.exception() is None
