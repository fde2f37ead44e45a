"""BudgetPeriods: UTC day/month keys and time to their ends."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from policies.quota import BudgetPeriods


def test_periods_and_time_to_end_in_utc():
    now = datetime(2024, 2, 29, 23, 59, 30, tzinfo=UTC).timestamp()
    periods = BudgetPeriods.at(now)
    assert (periods.day, periods.month) == ("d:2024-02-29", "m:2024-02")
    assert periods.seconds_to_day_end == pytest.approx(30.0)
    assert periods.seconds_to_month_end == pytest.approx(30.0)


def test_december_rolls_into_next_year():
    now = datetime(2025, 12, 15, 0, 0, 0, tzinfo=UTC).timestamp()
    periods = BudgetPeriods.at(now)
    assert periods.month == "m:2025-12"
    assert periods.seconds_to_month_end == pytest.approx(17 * 86_400)
