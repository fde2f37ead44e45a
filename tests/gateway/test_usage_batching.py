"""BatchedUsageReporter over a real SQLite store: summed per tenant and hour, flushed on time and at close."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from gateway.admission.base import FinalUsage
from gateway.admission.usage import BatchedUsageReporter
from gateway.store import SqliteStore, UsageTotals

HOUR_10 = 1_750_000_000.0 - 1_750_000_000.0 % 3600 + 36_000  # some 10:00 UTC


def test_reports_are_summed_per_hour_and_written_at_close(tmp_path):
    store = SqliteStore(tmp_path / "store.db")
    tenant = store.create_tenant("acme")
    clock = iter([HOUR_10 + 5, HOUR_10 + 3599, HOUR_10 + 3600]).__next__
    reporter = BatchedUsageReporter(store, flush_interval_s=60, clock=clock)

    async def scenario() -> None:
        await reporter.report(tenant, FinalUsage(10, 2, 4, "ok"))
        await reporter.report(tenant, FinalUsage(5, 1, 0, "error"))
        await reporter.report(tenant, FinalUsage(7, 3, 0, "ok"))  # the next hour
        assert store.usage_totals(tenant.id, 0, HOUR_10 + 7200) == UsageTotals()  # nothing written yet
        await reporter.close()

    asyncio.run(scenario())
    rows = store.usage(tenant.id, HOUR_10, HOUR_10 + 7200)
    assert [(r.bucket_start, r.requests, r.prompt_tokens, r.completion_tokens, r.cached_tokens) for r in rows] == [
        (HOUR_10, 2, 15, 3, 4), (HOUR_10 + 3600, 1, 7, 3, 0)]
    store.close()


def test_the_flusher_writes_within_the_interval_and_keeps_what_failed(tmp_path):
    store = SqliteStore(tmp_path / "store.db")
    tenant = store.create_tenant("acme")
    reporter = BatchedUsageReporter(store, flush_interval_s=0.05)

    async def scenario() -> None:
        await reporter.report(tenant, FinalUsage(3, 1, 0, "ok"))
        deadline = time.monotonic() + 5
        while store.usage_totals(tenant.id, 0, time.time() + 3600).requests != 1:
            assert time.monotonic() < deadline, "usage was not flushed"
            await asyncio.sleep(0.01)
        store.close()  # writes fail from now on: the report stays pending
        await reporter.report(tenant, FinalUsage(4, 2, 0, "ok"))
        await asyncio.sleep(0.2)
        assert reporter.pending_requests == 1
        reporter.store = SqliteStore(tmp_path / "store.db")
        await reporter.close()
        assert reporter.store.usage_totals(tenant.id, 0, time.time() + 3600) == UsageTotals(2, 7, 3, 0)
        reporter.store.close()

    asyncio.run(scenario())


def test_usage_of_a_deleted_tenant_is_dropped_not_retried(tmp_path):
    store = SqliteStore(tmp_path / "store.db")
    reporter = BatchedUsageReporter(store)
    ghost = replace(store.create_tenant("ghost"), id="ten_nope")  # a tenant id the store does not know

    async def scenario() -> None:
        await reporter.report(ghost, FinalUsage(1, 1, 0, "ok"))
        await reporter.close()

    asyncio.run(scenario())
    assert reporter.pending_requests == 0
    store.close()
