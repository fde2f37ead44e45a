"""RecentActivity (the dashboard's chart window): bucketing, percentiles, expiry, per-tenant counts."""

from __future__ import annotations

import pytest

from gateway.observability.telemetry import RecentActivity, percentile


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_buckets_hold_what_happened_in_them_and_expire():
    clock = Clock(1000.0)
    activity = RecentActivity(bucket_s=5.0, window_s=20.0, clock=clock)
    activity.add_output_tokens(10)
    for ttft in (0.1, 0.2, 0.3, 0.4):
        activity.add_first_token(ttft)
    activity.add_finished("acme", prompt_tokens=40, cached_tokens=10, ok=True)
    activity.add_sample(queue_depth=3, kv_usage=0.5)
    activity.add_sample(queue_depth=1, kv_usage=0.25)
    clock.now = 1007.0
    activity.add_refusal("acme")
    activity.add_finished("globex", prompt_tokens=8, cached_tokens=0, ok=False)

    series = activity.series()
    assert [p["t"] for p in series] == [990.0, 995.0, 1000.0, 1005.0]
    first, second = series[2], series[3]
    assert first["tokens_per_s"] == 2.0 and first["requests"] == 1 and first["cache_hit_ratio"] == 0.25
    assert first["ttft_p50_ms"] == pytest.approx(200.0) and first["ttft_p95_ms"] == pytest.approx(400.0)
    assert first["queue_depth"] == 3 and first["kv_usage"] == 0.25
    assert second["errors"] == 1 and second["refusals"] == 1 and second["ttft_p50_ms"] is None
    assert series[0]["requests"] == 0 and series[0]["cache_hit_ratio"] is None
    assert activity.requests_in_last(60) == {"acme": 2, "globex": 1}
    assert activity.requests_in_last(2) == {"acme": 1, "globex": 1}  # only the bucket from 1005 overlaps

    clock.now = 1030.0  # the first buckets leave the window
    assert activity.requests_in_last(60) == {}
    assert sum(p["tokens_per_s"] for p in activity.series()) == 0


def test_percentile_is_nearest_rank_and_config_is_checked():
    assert percentile([], 50) is None
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0 and percentile([5.0, 1.0, 3.0], 95) == 5.0
    with pytest.raises(ValueError, match="bucket_s"):
        RecentActivity(bucket_s=10.0, window_s=5.0)
