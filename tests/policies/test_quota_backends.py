"""The QuotaBackend contract (policies/quota.py), run against MemoryQuotaBackend and RedisQuotaBackend on a
real redis-server, with injected time: exact buckets, all-or-nothing, leases, budgets, reconcile.

Backend-specific behaviour stays beside each backend: the ledger and group commit in
test_memory_quota.py, several processes and the server clock in test_redis_quota.py."""

from __future__ import annotations

import math

import pytest

from policies.quota import BudgetPeriods, QuotaBackend, QuotaConfig, RefusalReason
from policies.tenant_policy import RequestTooLarge, TenantPolicy

T0 = 1_750_000_000.0


def test_requests_per_minute_exact_within_window_then_refills(quota_backends):
    policy = TenantPolicy(requests_per_minute=30, max_concurrent_requests=1000)

    async def scenario(backend: QuotaBackend) -> None:
        granted = 0
        for i in range(90):  # 90 requests over 1.8 s: less than one refill (2 s)
            granted += (await backend.admit("a", policy, 1, 1, T0 + i * 0.02)).granted
        assert granted == 30
        refused = await backend.admit("a", policy, 1, 1, T0 + 1.78)
        assert refused.reason is RefusalReason.REQUESTS
        assert refused.retry_after_s == pytest.approx(2.0 - 1.78)  # 0.89 refilled, 1 needed at 0.5/s
        again = [(await backend.admit("a", policy, 1, 1, T0 + 62.0)).granted for _ in range(40)]  # full again
        assert sum(again) == 30

    quota_backends.run(scenario)


def test_tokens_per_minute_reserves_prompt_plus_max_tokens_and_reconciles(quota_backends):
    policy = TenantPolicy(tokens_per_minute=3000, max_tokens_per_request=3000, max_concurrent_requests=100)

    async def scenario(backend: QuotaBackend) -> None:
        admissions = [await backend.admit("a", policy, 40, 60, T0) for _ in range(90)]
        assert sum(a.granted for a in admissions) == 30
        last_refusal = admissions[-1]
        assert last_refusal.reason is RefusalReason.TOKENS
        assert last_refusal.retry_after_s == pytest.approx(2.0)  # 100 tokens at 50/s
        assert last_refusal.snapshot.remaining_tokens == 0
        # each granted request used 40 of its 100: refunds make room for 18 more
        for admission in admissions[:30]:
            assert await backend.reconcile(admission.lease, 40, T0)
            assert not await backend.reconcile(admission.lease, 40, T0), "reconcile applies once"
            assert await backend.release(admission.lease)
        assert sum([(await backend.admit("a", policy, 40, 60, T0)).granted for _ in range(30)]) == 18

    quota_backends.run(scenario)


def test_refusal_takes_nothing(quota_backends):
    policy = TenantPolicy(requests_per_minute=10, tokens_per_minute=1000, max_tokens_per_request=1000)

    async def scenario(backend: QuotaBackend) -> None:
        assert (await backend.admit("a", policy, 500, 400, T0)).granted
        refused = await backend.admit("a", policy, 100, 100, T0)  # tokens fail (100 left), requests would pass
        assert refused.reason is RefusalReason.TOKENS
        assert refused.snapshot.remaining_requests == 9, "the refused request must not take a request"
        assert (await backend.admit("a", policy, 50, 50, T0)).granted
        assert (await backend.usage("a", T0)).in_flight == 2

    quota_backends.run(scenario)


def test_snapshot_and_reconcile_refund_the_token_bucket(quota_backends):
    policy = TenantPolicy(requests_per_minute=60, tokens_per_minute=6000, max_tokens_per_request=6000)

    async def scenario(backend: QuotaBackend) -> None:
        admission = await backend.admit("k", policy, 1000, 4000, T0)
        snap = admission.snapshot
        assert (snap.limit_requests, snap.limit_tokens) == (60, 6000)
        assert (snap.remaining_requests, snap.remaining_tokens) == (59, 1000)
        assert snap.reset_requests_s == pytest.approx(1.0)
        assert snap.reset_tokens_s == pytest.approx(50.0)
        refused = await backend.admit("k", policy, 1000, 1000, T0 + 1.0)  # bucket 1100 < 2000
        assert refused.reason is RefusalReason.TOKENS
        assert refused.retry_after_s == pytest.approx(9.0)
        assert await backend.reconcile(admission.lease, 1500, T0 + 1.0)  # refund 3500 -> 4600
        after = await backend.admit("k", policy, 1000, 1000, T0 + 1.0)
        assert after.granted and after.snapshot.remaining_tokens == 2600

    quota_backends.run(scenario)


def test_concurrency_leases_expire_renew_and_release_idempotently(quota_backends):
    policy = TenantPolicy(max_concurrent_requests=2)

    async def scenario(backend: QuotaBackend) -> None:
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
        assert not await backend.renew(second, T0 + 19.5), "an expired lease cannot be renewed"

    quota_backends.run(scenario, QuotaConfig(lease_ttl_s=10.0, concurrency_retry_after_s=0.5))


def test_a_dead_holders_lease_frees_after_the_ttl(quota_backends):
    policy = TenantPolicy(max_concurrent_requests=1)

    async def scenario(backend: QuotaBackend) -> None:
        lease = (await backend.admit("a", policy, 1, 1, T0)).lease
        assert not (await backend.admit("a", policy, 1, 1, T0 + 4.9)).granted
        assert (await backend.admit("a", policy, 1, 1, T0 + 5.0)).granted
        assert not await backend.release(lease), "the expired lease is gone"

    quota_backends.run(scenario, QuotaConfig(lease_ttl_s=5.0))


def test_budget_refuses_at_exactly_the_limit_and_reconcile_refunds_it(quota_backends):
    policy = TenantPolicy(daily_token_budget=1000, monthly_token_budget=5000)

    async def scenario(backend: QuotaBackend) -> None:
        first = await backend.admit("b", policy, 300, 300, T0)  # books 600
        assert first.granted
        assert (await backend.admit("b", policy, 200, 300, T0)).reason is RefusalReason.DAILY_BUDGET
        assert await backend.reconcile(first.lease, 400, T0)  # 600 -> 400 booked
        assert (await backend.admit("b", policy, 300, 300, T0)).granted  # 400 + 600 == 1000: allowed
        usage = await backend.usage("b", T0)
        assert (usage.day_tokens, usage.month_tokens) == (1000, 1000)
        refused = await backend.admit("b", policy, 1, 0, T0)  # used == budget: refused
        assert refused.reason is RefusalReason.DAILY_BUDGET and refused.reason.error_code == "insufficient_quota"
        assert "budget of 1000 tokens per day" in refused.message
        assert refused.retry_after_s == pytest.approx(math.ceil(T0 / 86_400) * 86_400 - T0)
        assert (await backend.admit("b", policy, 1, 0, T0 + 86_400)).granted  # the next UTC day

    quota_backends.run(scenario)


def test_reconcile_of_exactly_the_reservation_settles_once(quota_backends):
    """Refund 0 (served == reserved, the common case for fixed-length answers) settles like any other."""
    policy = TenantPolicy(daily_token_budget=1000)

    async def scenario(backend: QuotaBackend) -> None:
        admission = await backend.admit("z", policy, 16, 8, T0)
        assert await backend.reconcile(admission.lease, 24, T0)
        assert not await backend.reconcile(admission.lease, 24, T0), "reconcile applies once"
        usage = await backend.usage("z", T0)
        assert (usage.day_tokens, usage.month_tokens) == (24, 24)

    quota_backends.run(scenario)


def test_monthly_budget_wins_over_daily_and_rate_refusals(quota_backends):
    policy = TenantPolicy(daily_token_budget=100, monthly_token_budget=100, requests_per_minute=1)

    async def scenario(backend: QuotaBackend) -> None:
        assert (await backend.admit("a", policy, 50, 50, T0)).granted
        refused = await backend.admit("a", policy, 1, 0, T0)
        assert refused.reason is RefusalReason.MONTHLY_BUDGET
        assert refused.retry_after_s == pytest.approx(BudgetPeriods.at(T0).seconds_to_month_end)

    quota_backends.run(scenario)


def test_a_request_over_the_per_request_cap_is_an_error_not_a_refusal(quota_backends):
    async def scenario(backend: QuotaBackend) -> None:
        with pytest.raises(RequestTooLarge):
            await backend.admit("a", TenantPolicy(max_tokens_per_request=100), 60, 41, T0)
        assert (await backend.usage("a", T0)).in_flight == 0

    quota_backends.run(scenario)
