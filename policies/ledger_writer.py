"""`GroupCommitLedger`: group commit of budget deltas into a UsageLedger, off the event loop.

Semantics:
    queue(tenant, period, delta) -> batch   adds `delta` to the open batch (summed per (tenant, period))
                                            and returns that batch's future; never awaits, never touches
                                            the disk. The caller's in-memory counters stay its own.
    the flusher                             one task at a time: takes the open batch (a new one opens at
                                            once), writes it in ONE transaction on a worker thread, then
                                            resolves its future (result None, or the write's exception),
                                            and repeats while deltas are queued.
    await durable(batch)                    returns once that batch is committed; raises
                                            LedgerWriteFailed if its transaction failed. Cancelling the
                                            waiter never cancels the batch (other waiters share it).

So N admissions that arrive while one fsync runs share the next fsync: one transaction per batch instead
of one per delta, and no fsync ever blocks the event loop. A delta counts as durable only after its batch
committed; what a crash loses is only what nobody was told was durable.
"""

from __future__ import annotations

import asyncio
import logging

from policies.usage_ledger import UsageLedger

log = logging.getLogger(__name__)

Deltas = dict[tuple[str, str], int]  # (tenant id, period key) -> tokens to add (may be negative)


class LedgerWriteFailed(RuntimeError):
    """A batch of budget deltas could not be committed (nothing of that batch is in the ledger)."""


class GroupCommitLedger:
    """Batches `queue`d deltas into one committed transaction at a time (see the module docstring).

    Must be used from one event loop. `tokens` reads through to the ledger (committed values only)."""

    def __init__(self, ledger: UsageLedger) -> None:
        self.ledger = ledger
        self._open: Deltas = {}
        self._open_batch: asyncio.Future | None = None  # resolves when `_open` is committed
        self._flusher: asyncio.Task | None = None
        self.batches_written = 0  # transactions committed (for tests and stats)

    def tokens(self, tenant_id: str, period: str) -> int:
        return self.ledger.tokens(tenant_id, period)

    @property
    def pending(self) -> bool:
        """True while some queued delta is not committed yet."""
        return bool(self._open) or (self._flusher is not None and not self._flusher.done())

    def queue(self, tenant_id: str, period: str, delta: int) -> asyncio.Future:
        """Add `delta` to the open batch; its future resolves once the batch is committed."""
        loop = asyncio.get_running_loop()
        key = (tenant_id, period)
        self._open[key] = self._open.get(key, 0) + int(delta)
        if self._open_batch is None:
            self._open_batch = loop.create_future()
            self._open_batch.add_done_callback(_retrieve_exception)  # some batches are never awaited
        if self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush_while_queued(), name="budget-ledger-flusher")
        return self._open_batch

    @staticmethod
    async def durable(batch: asyncio.Future) -> None:
        """Wait until `batch` is committed. Raises LedgerWriteFailed when its transaction failed."""
        await asyncio.shield(batch)

    async def close(self) -> None:
        """Wait until everything queued so far is committed (errors were already reported to waiters)."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.shield(self._flusher)

    async def _flush_while_queued(self) -> None:
        while self._open:
            deltas, batch = self._open, self._open_batch
            self._open, self._open_batch = {}, None
            assert batch is not None
            try:
                await asyncio.to_thread(self.ledger.add_many, deltas)
            except Exception as e:
                log.error("budget ledger: a batch of %d deltas could not be committed: %s", len(deltas), e)
                batch.set_exception(LedgerWriteFailed(f"the budget ledger could not be written: {e}"))
                continue
            except asyncio.CancelledError:
                # The loop is going away; the thread may still commit, but nobody can be told.
                batch.set_exception(LedgerWriteFailed("the budget ledger writer was cancelled"))
                raise
            self.batches_written += 1
            batch.set_result(None)


def _retrieve_exception(batch: asyncio.Future) -> None:
    if not batch.cancelled():
        batch.exception()  # marks it retrieved; the flusher logged it already
