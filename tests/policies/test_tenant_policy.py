"""TenantPolicy: defaults, validation, priority resolution, request size."""

from __future__ import annotations

import pydantic
import pytest

from policies.tenant_policy import PriorityNotAllowed, RequestTooLarge, TenantPolicy


def test_defaults_are_consistent_and_budgets_unlimited():
    policy = TenantPolicy()
    assert policy.min_priority <= policy.default_priority <= policy.max_priority
    assert policy.max_tokens_per_request <= policy.tokens_per_minute
    assert policy.daily_token_budget is None and policy.monthly_token_budget is None


@pytest.mark.parametrize("fields, fragment", [
    ({"min_priority": 5, "max_priority": 2, "default_priority": 3}, "min_priority"),
    ({"default_priority": 0}, "default_priority"),
    ({"tokens_per_minute": 100, "max_tokens_per_request": 200}, "max_tokens_per_request"),
    ({"requests_per_minute": 0}, "requests_per_minute"),
    ({"fair_share_weight": 0}, "fair_share_weight"),
    ({"daily_token_budget": -1}, "daily_token_budget"),
    ({"unknown_field": 1}, "unknown_field"),
])
def test_invalid_policies_are_refused_with_the_field_named(fields, fragment):
    with pytest.raises(pydantic.ValidationError, match=fragment):
        TenantPolicy(**fields)


def test_policy_is_immutable():
    with pytest.raises(pydantic.ValidationError):
        TenantPolicy().requests_per_minute = 5  # type: ignore[misc]


def test_resolve_priority_defaults_accepts_range_and_refuses_outside():
    policy = TenantPolicy(min_priority=2, max_priority=4, default_priority=3)
    assert policy.resolve_priority(None) == 3
    assert [policy.resolve_priority(p) for p in (2, 3, 4)] == [2, 3, 4]
    for bad in (0, 1, 5):
        with pytest.raises(PriorityNotAllowed, match=r"outside this tenant's allowed range \[2, 4\]"):
            policy.resolve_priority(bad)
    for bad in (True, 2.0, "2"):
        with pytest.raises(PriorityNotAllowed, match="must be an integer"):
            policy.resolve_priority(bad)  # type: ignore[arg-type]


def test_request_size_reservation_and_default_max_tokens():
    policy = TenantPolicy(max_tokens_per_request=1000)
    assert policy.check_request_size(300, 700) == 1000
    with pytest.raises(RequestTooLarge, match="1001 exceeds"):
        policy.check_request_size(301, 700)
    with pytest.raises(ValueError, match=">= 0"):
        policy.check_request_size(-1, 5)
    assert policy.default_max_tokens(250) == 750
    with pytest.raises(RequestTooLarge, match="no room"):
        policy.default_max_tokens(1000)


def test_scaled_splits_rate_limits_but_not_budgets():
    policy = TenantPolicy(requests_per_minute=30, tokens_per_minute=3000, max_concurrent_requests=3,
                          max_tokens_per_request=2000, daily_token_budget=10)
    half = policy.scaled(0.5)
    assert (half.requests_per_minute, half.tokens_per_minute, half.max_concurrent_requests) == (15, 1500, 1)
    assert half.max_tokens_per_request == 1500
    assert half.daily_token_budget == 10
    with pytest.raises(ValueError, match="fraction"):
        policy.scaled(0)
