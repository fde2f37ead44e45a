"""UTC budget periods: the key a token count is booked under and the time until the period ends."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta


@dataclass(frozen=True)
class BudgetPeriods:
    """The day and month a moment falls in, as storage keys, and seconds until each one ends."""

    day: str  # "d:2025-01-31"
    month: str  # "m:2025-01"
    seconds_to_day_end: float
    seconds_to_month_end: float

    @classmethod
    def at(cls, now: float) -> BudgetPeriods:
        """Periods containing the unix time `now` (UTC calendar)."""
        moment = datetime.fromtimestamp(now, tz=UTC)
        day_start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
        next_day = day_start + timedelta(days=1)
        month_start = day_start.replace(day=1)
        next_month = (month_start + timedelta(days=32)).replace(day=1)
        return cls(
            day=f"d:{moment:%Y-%m-%d}",
            month=f"m:{moment:%Y-%m}",
            seconds_to_day_end=next_day.timestamp() - now,
            seconds_to_month_end=next_month.timestamp() - now,
        )
