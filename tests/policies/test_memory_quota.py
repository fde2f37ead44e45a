"""MemoryQuotaBackend with injected time: exact buckets, all-or-nothing, leases, budgets, durable restart."""

from __future__ import annotations

import asyncio

import pytest

from policies.budget_period import BudgetPeriods
from policies.memory_quota import MemoryQuotaBackend
from policies.quota import QuotaConfig, QuotaUnavailable, RefusalReason
from policies.tenant_policy import RequestTooLarge, TenantPolicy
from policies.usage_ledger import SqliteUsageLedger

T0 = 1_750_000_000.0


class ManualClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def run(coro):
    return asyncio.run(coro)


def test_requests_per_minute_exact_within_window_then_refills():
    async def scenario():
        clock = ManualClock(T0)
        backend = MemoryQuotaBackend(clock=clock)
        policy = TenantPolicy(requests_per_minute=30, max_concurrent_requests=1000)
        granted = 0
        for i in range(90):
            clock.now = T0 + i * 0.02  # 90 requests over 1.8 s: less than one refill (2 s)
            granted += (await backend.admit("a", policy, 1, 1)).granted
        assert granted == 30
        refused = await backend.admit("a", policy, 1, 1)
        assert refused.reason is RefusalReason.REQUESTS
        assert refused.retry_after_s == pytest.approx(2.0 - 1.78)  # 0.89 refilled, 1 needed at 0.5/s
        clock.now = T0 + 62.0  # full again
        assert sum([(await backend.admit("a", policy, 1, 1)).granted for _ in range(40)]) == 30
    run(scenario())


def test_tokens_per_minute_reserves_prompt_plus_max_tokens_and_reconciles():
    async def scenario():
        backend = MemoryQuotaBackend()
        policy = TenantPolicy(tokens_per_minute=3000, max_tokens_per_request=3000, max_concurrent_requests=100)
        admissions = [await backend.admit("a", policy, 40, 60, T0) for _ in range(90)]
        assert sum(a.granted for a in admissions) == 30
        last_refusal = admissions[-1]
        assert last_refusal.reason is RefusalReason.TOKENS
        assert last_refusal.retry_after_s == pytest.approx(2.0)  # 100 tokens at 50/s
        assert last_refusal.snapshot.remaining_tokens == 0
        # each granted request used 40 of its 100: refunds make room for 18 more
        for admission in admissions[:30]:
            assert await backend.reconcile(admission.lease, 40, T0)
            assert not await backend.reconcile(admission.lease, 40, T0)
            await backend.release(admission.lease)
        assert sum([(await backend.admit("a", policy, 40, 60, T0)).granted for _ in range(30)]) == 18
    run(scenario())


def test_refusal_takes_nothing():
    async def scenario():
        backend = MemoryQuotaBackend()
        policy = TenantPolicy(requests_per_minute=10, tokens_per_minute=1000, max_tokens_per_request=1000)
        assert (await backend.admit("a", policy, 500, 400, T0)).granted
        refused = await backend.admit("a", policy, 100, 100, T0)  # tokens fail (100 left), requests would pass
        assert refused.reason is RefusalReason.TOKENS
        assert refused.snapshot.remaining_requests == 9, "the refused request must not take a request"
        assert (await backend.admit("a", policy, 50, 50, T0)).granted
    run(scenario())


def test_concurrency_leases_expire_renew_and_release_idempotently():
    async def scenario():
        backend = MemoryQuotaBackend(QuotaConfig(lease_ttl_s=10.0, concurrency_retry_after_s=0.5))
        policy = TenantPolicy(max_concurrent_requests=2)
        first = (await backend.admit("a", policy, 1, 1, T0)).lease
        second = (await backend.admit("a", policy, 1, 1, T0)).lease
        refused = await backend.admit("a", policy, 1, 1, T0 + 1)
        assert refused.reason is RefusalReason.CONCURRENCY and refused.retry_after_s == 0.5
        assert refused.reason.error_code == "rate_limit_exceeded"
        assert await backend.release(first)
        assert not await backend.release(first)
        assert (await backend.admit("a", policy, 1, 1, T0 + 2)).granted
        assert await backend.renew(second, T0 + 9)  # second now lives until T0 + 19
        assert (await backend.usage("a", T0 + 11)).in_flight == 2
        assert (await backend.usage("a", T0 + 15)).in_flight == 1  # the one taken at T0 + 2 expired at T0 + 12
        assert not await backend.renew(first, T0 + 15), "a released lease cannot be renewed"
    run(scenario())


def test_dead_holder_lease_frees_after_ttl():
    async def scenario():
        backend = MemoryQuotaBackend(QuotaConfig(lease_ttl_s=5.0))
        policy = TenantPolicy(max_concurrent_requests=1)
        assert (await backend.admit("a", policy, 1, 1, T0)).granted
        assert not (await backend.admit("a", policy, 1, 1, T0 + 4.9)).granted
        assert (await backend.admit("a", policy, 1, 1, T0 + 5.0)).granted
    run(scenario())


def test_budget_refuses_at_exactly_the_limit():
    async def scenario():
        backend = MemoryQuotaBackend()
        policy = TenantPolicy(daily_token_budget=1000)
        assert (await backend.admit("a", policy, 500, 500, T0)).granted  # used + R == budget: allowed
        refused = await backend.admit("a", policy, 1, 0, T0)  # used == budget: refused
        assert refused.reason is RefusalReason.DAILY_BUDGET
        assert refused.reason.error_code == "insufficient_quota"
        assert "budget of 1000 tokens per day" in refused.message
        assert (await backend.admit("a", policy, 1, 0, T0 + 86_400)).granted  # next UTC day
    run(scenario())


def test_monthly_budget_wins_over_daily_and_rate_refusals():
    async def scenario():
        backend = MemoryQuotaBackend()
        policy = TenantPolicy(daily_token_budget=100, monthly_token_budget=100, requests_per_minute=1)
        assert (await backend.admit("a", policy, 50, 50, T0)).granted
        refused = await backend.admit("a", policy, 1, 0, T0)
        assert refused.reason is RefusalReason.MONTHLY_BUDGET
        assert refused.retry_after_s == pytest.approx(BudgetPeriods.at(T0).seconds_to_month_end)
    run(scenario())


def test_request_larger_than_the_per_request_cap_is_an_error_not_a_refusal():
    backend = MemoryQuotaBackend()
    with pytest.raises(RequestTooLarge):
        run(backend.admit("a", TenantPolicy(max_tokens_per_request=100), 60, 41, T0))


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
