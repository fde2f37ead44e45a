"""UTC buckets: day boundaries, overlap spans, grouping hours into days."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gateway.store.models import UsageRow, UsageTotals
from gateway.store.usage_buckets import day_range, group_hours, hour_span


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0) -> int:
    return int(datetime(year, month, day, hour, minute, second, tzinfo=UTC).timestamp())


def test_day_range_handles_a_leap_day() -> None:
    assert day_range(utc(2024, 2, 29, 12) + 0.5) == (utc(2024, 2, 29), utc(2024, 3, 1))


def test_hour_span_covers_overlapping_buckets() -> None:
    assert hour_span(utc(2024, 1, 1, 10, 30), utc(2024, 1, 1, 12), "hour") == (utc(2024, 1, 1, 10), utc(2024, 1, 1, 12))
    assert hour_span(utc(2024, 1, 1, 10), utc(2024, 1, 1, 12, 0, 1), "hour")[1] == utc(2024, 1, 1, 13)
    assert hour_span(utc(2024, 1, 1, 10), utc(2024, 1, 2, 1), "day") == (utc(2024, 1, 1), utc(2024, 1, 3))
    with pytest.raises(ValueError, match="before since"):
        hour_span(10, 5, "hour")


def test_group_hours_into_days() -> None:
    hours = [(utc(2024, 1, 1, 3), UsageTotals(1, 2, 3, 4)), (utc(2024, 1, 1, 23), UsageTotals(1, 1, 1, 1)),
             (utc(2024, 1, 2, 0), UsageTotals(5, 0, 0, 0))]
    assert group_hours("t", hours, "day") == [
        UsageRow("t", utc(2024, 1, 1), "day", 2, 3, 4, 5), UsageRow("t", utc(2024, 1, 2), "day", 5, 0, 0, 0)
    ]
    assert [r.bucket_start for r in group_hours("t", hours, "hour")] == [h for h, _ in hours]
