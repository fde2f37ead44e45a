"""GroupCommitLedger: concurrent deltas share transactions, waiters learn the outcome, nothing is lost."""

from __future__ import annotations

import asyncio

import pytest

from policies.ledger_writer import GroupCommitLedger, LedgerWriteFailed
from policies.usage_ledger import SqliteUsageLedger


def test_concurrent_deltas_share_transactions_and_are_durable_when_awaited(tmp_path):
    path = tmp_path / "ledger.sqlite"

    async def scenario() -> int:
        ledger = SqliteUsageLedger(path)
        writer = GroupCommitLedger(ledger)

        async def book(i: int) -> None:
            batch = writer.queue(f"t{i % 3}", "d:2025-01-01", 10)
            await writer.durable(batch)
            assert ledger.tokens(f"t{i % 3}", "d:2025-01-01") >= 10  # committed before durable() returned

        await asyncio.gather(*(book(i) for i in range(60)))
        assert not writer.pending
        ledger.close()
        return writer.batches_written

    batches = asyncio.run(scenario())
    assert 1 <= batches < 60  # group commit: far fewer transactions than deltas
    reopened = SqliteUsageLedger(path)
    assert [reopened.tokens(f"t{i}", "d:2025-01-01") for i in range(3)] == [200, 200, 200]
    reopened.close()


def test_a_failed_commit_reaches_every_waiter_and_later_batches_still_commit(tmp_path):
    async def scenario() -> None:
        ledger = SqliteUsageLedger(tmp_path / "ledger.sqlite")
        writer = GroupCommitLedger(ledger)
        ledger.close()  # every write now fails for real: the database is closed
        batches = [writer.queue("a", "d:2025-01-01", 5) for _ in range(3)]
        for batch in batches:
            with pytest.raises(LedgerWriteFailed, match="could not be written"):
                await writer.durable(batch)
        reopened = SqliteUsageLedger(tmp_path / "ledger.sqlite")
        writer.ledger = reopened
        await writer.durable(writer.queue("a", "d:2025-01-01", 7))
        assert reopened.tokens("a", "d:2025-01-01") == 7  # the failed batch left nothing behind
        reopened.close()

    asyncio.run(scenario())


def test_a_cancelled_waiter_does_not_cancel_the_batch_and_close_waits_for_it(tmp_path):
    async def scenario() -> None:
        ledger = SqliteUsageLedger(tmp_path / "ledger.sqlite")
        writer = GroupCommitLedger(ledger)
        batch = writer.queue("a", "m:2025-01", 3)
        other = writer.queue("b", "m:2025-01", 4)
        assert batch is other  # one open batch until the flusher takes it
        waiter = asyncio.ensure_future(writer.durable(batch))
        await asyncio.sleep(0)
        waiter.cancel()
        await writer.close()
        assert not batch.cancelled() and batch.exception() is None
        assert (ledger.tokens("a", "m:2025-01"), ledger.tokens("b", "m:2025-01")) == (3, 4)
        ledger.close()

    asyncio.run(scenario())
