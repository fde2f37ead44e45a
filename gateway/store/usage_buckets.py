"""UTC time buckets for usage counters: hours are stored, days are sums of hours."""

from __future__ import annotations

import math
from collections.abc import Iterable

from gateway.store.models import Granularity, UsageRow, UsageTotals

HOUR = 3600
DAY = 86400
BUCKET_SECONDS: dict[str, int] = {"hour": HOUR, "day": DAY}


def bucket_seconds(granularity: Granularity) -> int:
    try:
        return BUCKET_SECONDS[granularity]
    except KeyError:
        raise ValueError(f"granularity must be 'hour' or 'day', got {granularity!r}") from None


def floor_to(at: float, seconds: int) -> int:
    return int(math.floor(at / seconds)) * seconds


def ceil_to(at: float, seconds: int) -> int:
    return int(math.ceil(at / seconds)) * seconds


def day_range(at: float) -> tuple[int, int]:
    """[start, end) of the UTC day holding `at`."""
    start = floor_to(at, DAY)
    return start, start + DAY


def hour_span(since: float, until: float, granularity: Granularity) -> tuple[int, int]:
    """Hour buckets to read for the `granularity` buckets that overlap [since, until).

    Whole buckets are reported: a query from 10:30 includes the 10:00 hour (or the whole day).
    """
    size = bucket_seconds(granularity)
    if until < since:
        raise ValueError(f"until ({until}) is before since ({since})")
    return floor_to(since, size), ceil_to(until, size)


def group_hours(
    tenant_id: str, hours: Iterable[tuple[int, UsageTotals]], granularity: Granularity
) -> list[UsageRow]:
    """Hour counters (bucket_start, totals) → rows of `granularity`, ordered by bucket_start."""
    size = bucket_seconds(granularity)
    sums: dict[int, list[int]] = {}
    for start, t in hours:
        acc = sums.setdefault(floor_to(start, size), [0, 0, 0, 0])
        acc[0] += t.requests
        acc[1] += t.prompt_tokens
        acc[2] += t.completion_tokens
        acc[3] += t.cached_tokens
    return [
        UsageRow(tenant_id, start, granularity, *acc)
        for start, acc in sorted(sums.items())
    ]


def sum_totals(parts: Iterable[UsageTotals]) -> UsageTotals:
    acc = [0, 0, 0, 0]
    for t in parts:
        acc[0] += t.requests
        acc[1] += t.prompt_tokens
        acc[2] += t.completion_tokens
        acc[3] += t.cached_tokens
    return UsageTotals(*acc)
