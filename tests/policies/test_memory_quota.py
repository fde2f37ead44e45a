"""MemoryQuotaBackend's own behaviour: its injected clock, and budgets made durable through the ledger
(restart, group commit, a failing disk, cancellation). The contract every QuotaBackend keeps (buckets,
leases, budgets, reconcile) is tested once for all backends in test_quota_backends.py."""

from __future__ import annotations

import asyncio

import pytest

from policies.memory_quota import MemoryQuotaBackend
from policies.quota import BudgetPeriods, QuotaUnavailable, RefusalReason
from policies.tenant_policy import TenantPolicy
from policies.usage_ledger import SqliteUsageLedger

T0 = 1_750_000_000.0


class ManualClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def run(coro):
    return asyncio.run(coro)


def test_without_now_the_injected_clock_decides():
    async def scenario() -> None:
        clock = ManualClock(T0)
        backend = MemoryQuotaBackend(clock=clock)
        policy = TenantPolicy(requests_per_minute=2)
        assert [(await backend.admit("a", policy, 1, 1)).granted for _ in range(3)] == [True, True, False]
        clock.now = T0 + 30.0  # one request refilled
        assert (await backend.admit("a", policy, 1, 1)).granted
        assert (await backend.usage("a")).in_flight == 1  # the first two leases expired with the 30 s ttl
    run(scenario())


def test_budget_usage_survives_a_restart_through_the_ledger(tmp_path):
    async def first_life():
        ledger = SqliteUsageLedger(tmp_path / "usage.sqlite")
        backend = MemoryQuotaBackend(ledger=ledger)
        policy = TenantPolicy(daily_token_budget=1000)
        admission = await backend.admit("a", policy, 300, 300, T0)
        await backend.reconcile(admission.lease, 450, T0)
        unreconciled = await backend.admit("a", policy, 100, 100, T0)  # the gateway "dies" mid-request
        assert unreconciled.granted
        ledger.close()

    async def second_life():
        ledger = SqliteUsageLedger(tmp_path / "usage.sqlite")
        backend = MemoryQuotaBackend(ledger=ledger)
        usage = await backend.usage("a", T0)
        assert (usage.day_tokens, usage.month_tokens) == (650, 650)
        policy = TenantPolicy(daily_token_budget=1000)
        assert (await backend.admit("a", policy, 200, 150, T0)).granted  # 650 + 350 == 1000
        assert (await backend.admit("a", policy, 1, 0, T0)).reason is RefusalReason.DAILY_BUDGET
        ledger.close()

    run(first_life())
    run(second_life())


def test_first_booking_with_a_ledger_counts_once(tmp_path):
    async def go():
        ledger = SqliteUsageLedger(tmp_path / "usage.sqlite")
        backend = MemoryQuotaBackend(ledger=ledger)
        policy = TenantPolicy(monthly_token_budget=1000)  # the day period is booked without being checked
        first = await backend.admit("a", policy, 300, 300, T0)
        await backend.reconcile(first.lease, 450, T0)
        usage = await backend.usage("a", T0)
        assert (usage.day_tokens, usage.month_tokens) == (450, 450)
        ledger.close()

    run(go())


def test_tenants_without_a_budget_never_write_the_ledger_but_a_later_budget_counts_the_period(tmp_path):
    async def scenario() -> None:
        ledger = SqliteUsageLedger(tmp_path / "usage.sqlite")
        backend = MemoryQuotaBackend(ledger=ledger)
        free = TenantPolicy()
        first = await backend.admit("a", free, 100, 100, T0)
        await backend.reconcile(first.lease, 150, T0)
        periods = BudgetPeriods.at(T0)
        assert ledger.tokens("a", periods.day) == 0  # nothing written: no budget to protect
        assert (await backend.usage("a", T0)).day_tokens == 150  # but counted
        budgeted = TenantPolicy(daily_token_budget=1000)
        second = await backend.admit("a", budgeted, 100, 100, T0)
        assert ledger.tokens("a", periods.day) == 350  # the earlier 150 came along with the first booking
        await backend.reconcile(second.lease, 50, T0)
        assert (ledger.tokens("a", periods.day), ledger.tokens("a", periods.month)) == (200, 200)
        await backend.close()
        ledger.close()

    run(scenario())


def test_concurrent_budgeted_admissions_share_commits_and_survive_a_restart(tmp_path):
    policy = TenantPolicy(daily_token_budget=10_000, max_concurrent_requests=100)

    async def first_life() -> int:
        ledger = SqliteUsageLedger(tmp_path / "usage.sqlite")
        backend = MemoryQuotaBackend(ledger=ledger)
        admissions = await asyncio.gather(*(backend.admit("a", policy, 50, 50, T0) for _ in range(40)))
        assert all(a.granted for a in admissions)
        assert ledger.tokens("a", BudgetPeriods.at(T0).day) == 4000  # durable once admit returned
        writes = backend._ledger.batches_written
        await backend.close()
        ledger.close()
        return writes

    async def second_life() -> None:
        ledger = SqliteUsageLedger(tmp_path / "usage.sqlite")
        backend = MemoryQuotaBackend(ledger=ledger)
        assert (await backend.usage("a", T0)).day_tokens == 4000
        ledger.close()

    assert run(first_life()) < 40
    run(second_life())


def test_a_ledger_that_cannot_be_written_refuses_with_503_and_takes_the_grant_back(tmp_path):
    async def scenario() -> None:
        ledger = SqliteUsageLedger(tmp_path / "usage.sqlite")
        backend = MemoryQuotaBackend(ledger=ledger)
        policy = TenantPolicy(daily_token_budget=1000, requests_per_minute=2, max_concurrent_requests=1)
        first = await backend.admit("a", policy, 10, 10, T0)
        await backend.reconcile(first.lease, 20, T0)
        await backend.release(first.lease)
        ledger.close()  # the disk "fails": every write raises from now on
        with pytest.raises(QuotaUnavailable, match="budget ledger"):
            await backend.admit("a", policy, 10, 10, T0)
        usage = await backend.usage("a", T0)
        assert (usage.in_flight, usage.day_tokens) == (0, 20)  # no lease, no booking left behind
        refused = await backend.admit("a", TenantPolicy(requests_per_minute=2, max_concurrent_requests=1), 1, 1, T0)
        assert refused.granted  # the request taken by the failed admission was given back (1 of 2 used)
        await backend.close()

    run(scenario())


def test_an_admission_cancelled_while_its_booking_commits_gives_everything_back(tmp_path):
    async def scenario() -> None:
        ledger = SqliteUsageLedger(tmp_path / "usage.sqlite")
        backend = MemoryQuotaBackend(ledger=ledger)
        policy = TenantPolicy(daily_token_budget=1000, max_concurrent_requests=1)
        admitting = asyncio.ensure_future(backend.admit("a", policy, 10, 10, T0))
        await asyncio.sleep(0)  # decided and booked in memory; the commit is on its way
        admitting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await admitting
        await backend.close()  # the booking's commit, then its give-back's
        usage = await backend.usage("a", T0)
        assert (usage.in_flight, usage.day_tokens) == (0, 0)
        assert ledger.tokens("a", BudgetPeriods.at(T0).day) == 0
        assert (await backend.admit("a", policy, 10, 10, T0)).granted  # the concurrency slot is free
        await backend.close()
        ledger.close()

    run(scenario())
