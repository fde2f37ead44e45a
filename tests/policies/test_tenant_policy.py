"""TenantPolicy: defaults, validation, the one parser (overrides, edits), priority resolution, request size."""

from __future__ import annotations

import pydantic
import pytest

from policies.tenant_policy import InvalidPolicy, PriorityNotAllowed, RequestTooLarge, TenantPolicy


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


def test_request_size_reservation():
    policy = TenantPolicy(max_tokens_per_request=1000)
    assert policy.check_request_size(300, 700) == 1000
    with pytest.raises(RequestTooLarge, match="1001 exceeds"):
        policy.check_request_size(301, 700)
    with pytest.raises(ValueError, match=">= 0"):
        policy.check_request_size(-1, 5)


def test_unset_fields_follow_the_fields_an_operator_set():
    narrowed = TenantPolicy.parse({"max_priority": 4, "tokens_per_minute": 300})
    assert (narrowed.default_priority, narrowed.max_tokens_per_request) == (4, 300)
    assert TenantPolicy.parse({"min_priority": 7}).default_priority == 7
    assert TenantPolicy(max_priority=4) == narrowed.with_changes({"tokens_per_minute": None})


def test_overrides_are_what_the_operator_set_and_parse_back_to_the_same_policy():
    policy = TenantPolicy.parse({"max_priority": 4, "fair_share_weight": 3, "share_prefix_cache": True})
    assert policy.overrides() == {"max_priority": 4, "fair_share_weight": 3.0, "share_prefix_cache": True}
    assert TenantPolicy.parse(policy.overrides()) == policy
    assert TenantPolicy.parse(None) == TenantPolicy() and TenantPolicy().overrides() == {}


def test_with_changes_sets_clears_and_leaves_the_original_alone():
    policy = TenantPolicy.parse({"max_priority": 4})
    changed = policy.with_changes({"requests_per_minute": 5, "max_priority": None})
    assert changed.overrides() == {"requests_per_minute": 5}
    assert changed.default_priority == 5 and policy.overrides() == {"max_priority": 4}


@pytest.mark.parametrize("value, field", [
    ({"requests_per_minute": 0}, "requests_per_minute"),
    ({"requests_per_minute": "5"}, "requests_per_minute"),  # strict JSON types: no coercion
    ({"share_prefix_cache": 1}, "share_prefix_cache"),
    ({"max_adapters": True}, "max_adapters"),
    ({"rpm": 3}, "rpm"),
    ({"rpm": None}, "rpm"),  # clearing a field that does not exist is refused too
    ({"min_priority": 5, "max_priority": 4}, "max_priority"),
    ({"default_priority": 0}, "default_priority"),
    ([1, 2], "policy"),
])
def test_every_invalid_policy_is_one_error_naming_the_field(value, field):
    with pytest.raises(InvalidPolicy) as refused:
        TenantPolicy().with_changes(value) if isinstance(value, dict) else TenantPolicy.parse(value)
    assert refused.value.field == field and field in str(refused.value)
    assert isinstance(refused.value, ValueError)


def test_scaled_splits_rate_limits_but_not_budgets():
    policy = TenantPolicy(requests_per_minute=30, tokens_per_minute=3000, max_concurrent_requests=3,
                          max_tokens_per_request=2000, daily_token_budget=10)
    half = policy.scaled(0.5)
    assert (half.requests_per_minute, half.tokens_per_minute, half.max_concurrent_requests) == (15, 1500, 1)
    assert half.max_tokens_per_request == 1500
    assert half.daily_token_budget == 10
    with pytest.raises(ValueError, match="fraction"):
        policy.scaled(0)
