"""TokenBucket arithmetic: continuous refill, all-or-nothing takes, waits, resets."""

from __future__ import annotations

import pytest

from policies.quota import TokenBucket


def test_burst_of_limit_then_refill_at_limit_per_minute():
    bucket = TokenBucket.full(30, now=0.0)
    taken = 0
    for _ in range(90):
        if bucket.can_take(1):
            bucket.take(1)
            taken += 1
    assert taken == 30
    bucket.refill(1.99, 30)
    assert not bucket.can_take(1)  # 0.995 tokens refilled
    bucket.refill(2.0, 30)
    assert bucket.can_take(1)
    bucket.refill(1000.0, 30)
    assert bucket.level == 30.0  # capped at capacity


def test_wait_reset_and_remaining():
    bucket = TokenBucket.full(600, now=0.0)  # 10 tokens/s
    bucket.take(550)
    assert bucket.remaining() == 50
    assert bucket.wait_seconds(100) == pytest.approx(5.0)
    assert bucket.wait_seconds(10) == 0.0
    assert bucket.reset_seconds() == pytest.approx(55.0)
    with pytest.raises(ValueError, match="cannot take 51"):
        bucket.take(51)


def test_adjust_refunds_up_to_capacity_and_debt_down_to_minus_capacity():
    bucket = TokenBucket.full(100, now=0.0)
    bucket.take(80)
    bucket.adjust(500)
    assert bucket.level == 100.0
    bucket.adjust(-1000)
    assert bucket.level == -100.0
    assert bucket.remaining() == 0


def test_clock_going_backwards_does_not_refill_or_rewind():
    bucket = TokenBucket.full(60, now=10.0)
    bucket.take(60)
    bucket.refill(5.0, 60)
    assert bucket.level == 0.0 and bucket.updated_at == 10.0


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        TokenBucket.full(0, now=0.0)
