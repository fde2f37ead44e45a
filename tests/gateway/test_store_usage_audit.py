"""Store contract, usage counters and the audit log: runs against SQLite and a real Redis."""

from __future__ import annotations

import threading
from datetime import UTC, datetime

import pytest

from gateway.store import NotFoundError, Store, UsageRow, UsageTotals, open_store


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0) -> float:
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC).timestamp()


def test_hour_rows_sum_within_an_hour(store: Store) -> None:
    t = store.create_tenant("acme")
    store.record_usage(t.id, utc(2024, 5, 3, 10, 5), 1, 100, 20, 50)
    store.record_usage(t.id, utc(2024, 5, 3, 10, 59, 59), 2, 10, 2, 0)
    store.record_usage(t.id, utc(2024, 5, 3, 12, 0), 1, 7, 3, 1)
    rows = store.usage(t.id, utc(2024, 5, 3), utc(2024, 5, 4))
    assert rows == [
        UsageRow(t.id, int(utc(2024, 5, 3, 10)), "hour", 3, 110, 22, 50),
        UsageRow(t.id, int(utc(2024, 5, 3, 12)), "hour", 1, 7, 3, 1),
    ]
    # buckets overlapping [10:30, 12:00) are whole hours: only the 10:00 one has usage
    assert [r.bucket_start for r in store.usage(t.id, utc(2024, 5, 3, 10, 30), utc(2024, 5, 3, 12))] == [
        int(utc(2024, 5, 3, 10))
    ]
    assert store.usage(t.id, utc(2024, 5, 3, 11), utc(2024, 5, 3, 11)) == []


def test_day_rows_aggregate_hours(store: Store) -> None:
    t = store.create_tenant("acme")
    store.record_usage(t.id, utc(2024, 5, 3, 1), 1, 10, 1, 0)
    store.record_usage(t.id, utc(2024, 5, 3, 23, 30), 1, 20, 2, 5)
    store.record_usage(t.id, utc(2024, 5, 5, 0, 0, 1), 4, 40, 4, 0)
    rows = store.usage(t.id, utc(2024, 5, 3, 12), utc(2024, 5, 5, 0, 0, 1), granularity="day")
    assert rows == [
        UsageRow(t.id, int(utc(2024, 5, 3)), "day", 2, 30, 3, 5),
        UsageRow(t.id, int(utc(2024, 5, 5)), "day", 4, 40, 4, 0),
    ]
    assert store.usage_totals(t.id, utc(2024, 5, 3), utc(2024, 5, 4)) == UsageTotals(2, 30, 3, 5)
    with pytest.raises(ValueError, match="granularity"):
        store.usage(t.id, 0, 1, granularity="week")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="before since"):
        store.usage(t.id, 10, 0)


def test_day_totals(store: Store) -> None:
    t = store.create_tenant("acme")
    store.record_usage(t.id, utc(2024, 4, 30, 23, 59), 1, 1000, 0, 0)  # previous month
    store.record_usage(t.id, utc(2024, 5, 1, 0, 0), 1, 10, 1, 0)
    store.record_usage(t.id, utc(2024, 5, 17, 8), 2, 20, 2, 2)
    store.record_usage(t.id, utc(2024, 5, 17, 20), 3, 30, 3, 3)
    store.record_usage(t.id, utc(2024, 5, 31, 23, 59), 4, 40, 4, 4)
    store.record_usage(t.id, utc(2024, 6, 1), 100, 1, 1, 1)  # next month
    assert store.day_totals(t.id, utc(2024, 5, 17, 12)) == UsageTotals(5, 50, 5, 5)
    assert store.day_totals(t.id, utc(2024, 5, 18)) == UsageTotals()
    assert store.day_totals(t.id, utc(2024, 5, 31, 12)).total_tokens == 44


def test_tenants_do_not_see_each_others_usage(store: Store) -> None:
    a, b = store.create_tenant("acme"), store.create_tenant("globex")
    store.record_usage(a.id, utc(2024, 5, 3, 10), 1, 5, 5, 0)
    assert store.usage(b.id, utc(2024, 5, 3), utc(2024, 5, 4)) == []
    assert store.day_totals(b.id, utc(2024, 5, 3)) == UsageTotals()


def test_concurrent_increments_are_not_lost(store: Store) -> None:
    t = store.create_tenant("acme")
    at = utc(2024, 5, 3, 10, 15)

    def worker() -> None:
        for _ in range(25):
            store.record_usage(t.id, at, 1, 3, 2, 1)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert store.day_totals(t.id, at) == UsageTotals(200, 600, 400, 200)
    assert store.usage(t.id, at, at + 1)[0].requests == 200


def test_usage_arguments_are_validated(store: Store) -> None:
    t = store.create_tenant("acme")
    with pytest.raises(NotFoundError, match="tenant"):
        store.record_usage("ten_missing", utc(2024, 5, 3), 1, 1, 1, 0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        store.record_usage(t.id, utc(2024, 5, 3), 1, -1, 0, 0)
    with pytest.raises(ValueError, match="requests"):
        store.record_usage(t.id, utc(2024, 5, 3), 1.5, 0, 0, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="now"):
        store.record_usage(t.id, float("nan"))
    assert store.day_totals(t.id, utc(2024, 5, 3)) == UsageTotals()


def test_audit_is_newest_first_with_paging(store: Store) -> None:
    first = store.append_audit("cli", "tenant.create", "ten_1", after={"name": "acme"}, at=100.0)
    second = store.append_audit("key_abc", "tenant.policy.update", "ten_1",
                                before={"rpm": 1}, after={"rpm": 2, "tags": ["a", None]}, at=200.0)
    third = store.append_audit("cli", "tenant.suspend", "ten_1", at=300.0)
    assert first.id < second.id < third.id
    assert store.list_audit() == [third, second, first]
    assert store.list_audit(limit=2) == [third, second]
    assert store.list_audit(limit=2, before_id=second.id) == [first]
    assert store.list_audit(before_id=first.id) == []
    got = store.list_audit()[1]
    assert got.before == {"rpm": 1} and got.after == {"rpm": 2, "tags": ["a", None]} and got.at == 200.0
    assert got.actor == "key_abc" and got.action == "tenant.policy.update" and got.target == "ten_1"
    assert store.list_audit()[0].before is None


def test_audit_arguments_are_validated(store: Store) -> None:
    with pytest.raises(ValueError, match="actor"):
        store.append_audit("", "x", "y")
    with pytest.raises(ValueError, match="not JSON-serializable"):
        store.append_audit("cli", "x", "y", after={1, 2})
    with pytest.raises(ValueError, match="limit"):
        store.list_audit(limit=0)
    assert store.list_audit() == []


def test_usage_and_audit_survive_reopen(store: Store, store_url: str) -> None:
    t = store.create_tenant("acme")
    store.record_usage(t.id, utc(2024, 5, 3, 10), 2, 20, 10, 5)
    entry = store.append_audit("cli", "tenant.create", t.id, after={"name": "acme"}, at=5.0)
    store.close()
    with open_store(store_url) as again:
        assert again.day_totals(t.id, utc(2024, 5, 3)) == UsageTotals(2, 20, 10, 5)
        assert again.list_audit() == [entry]
        again.record_usage(t.id, utc(2024, 5, 3, 10, 30), 1, 1, 1, 1)
        assert again.day_totals(t.id, utc(2024, 5, 3)) == UsageTotals(3, 21, 11, 6)
        assert again.append_audit("cli", "tenant.suspend", t.id).id > entry.id
