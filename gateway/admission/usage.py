"""`BatchedUsageReporter`: final usage summed in memory and written to the store once a second, off the
request path (a UsageReporter, gateway/admission/base.py).

Semantics:
    report(tenant, usage, labels)
                           adds 1 request and the usage's tokens to the pending totals of (tenant, UTC hour
                           now) and, given the request's labels, its RequestRecord to the tenant's pending
                           records; no I/O, never awaits longer than a dict update.
    flusher                every `flush_interval_s` writes what is pending on a worker thread: one
                           `Store.record_usage` per (tenant, hour), stamped at that hour, so the hourly
                           counters are the same as with one write per request, and one
                           `Store.record_requests` per tenant. A write that fails is added back and retried at
                           the next flush (logged); records are idempotent by request id. At most
                           `max_pending_records` records wait: past that new ones are dropped (counted in
                           `dropped_records`, logged), so a store that is down for long cannot exhaust memory.
    close()                stops the flusher and writes everything still pending: a clean shutdown loses
                           nothing.
Loss window: a gateway killed without shutdown (SIGKILL, OOM, power cut) loses at most the usage reported in
its last `flush_interval_s` (1 s by default) plus a write in flight. Budgets are not affected: they are
enforced from the quota backend's own durable counters (policies/usage_ledger.py, or Redis).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.admission.base import FinalUsage, RequestLabels
from gateway.store import RequestRecord, Store, Tenant
from gateway.store.errors import NotFoundError
from gateway.store.usage_buckets import HOUR, floor_to

log = logging.getLogger(__name__)
MAX_PENDING_RECORDS = 100_000


@dataclass
class UsageCounts:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class BatchedUsageReporter:
    def __init__(self, store: Store, flush_interval_s: float = 1.0, clock: Callable[[], float] = time.time,
                 max_pending_records: int = MAX_PENDING_RECORDS) -> None:
        if not 0 < flush_interval_s <= 60:
            raise ValueError(f"flush_interval_s must be in (0, 60], got {flush_interval_s}")
        if max_pending_records < 1:
            raise ValueError(f"max_pending_records must be >= 1, got {max_pending_records}")
        self.store = store
        self.flush_interval_s = flush_interval_s
        self.max_pending_records = max_pending_records
        self.dropped_records = 0
        self._clock = clock
        self._pending: dict[tuple[str, float], UsageCounts] = {}  # (tenant id, hour start) -> totals
        self._writing: dict[tuple[str, float], UsageCounts] = {}  # the batch a flush is writing now
        self._writing_records: dict[str, list[RequestRecord]] = {}
        self._records: dict[str, list[RequestRecord]] = {}  # tenant id -> records not written yet, oldest first
        self._num_records = 0
        self._flusher: asyncio.Task | None = None
        self._closing = asyncio.Event()
        self._closed = False

    async def report(self, tenant: Tenant, usage: FinalUsage, labels: RequestLabels | None = None) -> None:
        self.add(tenant.id, floor_to(self._clock(), HOUR), UsageCounts(1, usage.prompt_tokens, usage.completion_tokens,
                                                                    usage.cached_tokens))
        if labels is not None:
            try:
                record = labels.record(tenant.id, usage)
            except ValueError as e:  # the edge checks every label; usage must never fail a served request
                log.error("request %s has no usage record: %s", labels.request_id, e)
            else:
                self.add_records(tenant.id, [record])
        if self._closed:  # a request that settled after shutdown began: write it now
            await self.flush()
        elif self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush_every_interval(),
                                                                   name="usage-flusher")

    def add(self, tenant_id: str, hour_start: float, counts: UsageCounts) -> None:
        pending = self._pending.setdefault((tenant_id, hour_start), UsageCounts())
        pending.requests += counts.requests
        pending.prompt_tokens += counts.prompt_tokens
        pending.completion_tokens += counts.completion_tokens
        pending.cached_tokens += counts.cached_tokens

    def add_records(self, tenant_id: str, records: list[RequestRecord]) -> None:
        """Queue records for the next flush; those past `max_pending_records` are dropped and counted."""
        room = max(0, self.max_pending_records - self.pending_records)
        if room:
            self._records.setdefault(tenant_id, []).extend(records[:room])
            self._num_records += min(room, len(records))
        if len(records) > room:
            before = self.dropped_records
            self.dropped_records += len(records) - room
            if before == 0 or before // 1000 != self.dropped_records // 1000:
                log.warning("%d request records dropped so far: the store has not taken them for a while",
                            self.dropped_records)

    @property
    def pending_records(self) -> int:
        """Request records not written yet (a batch being written included)."""
        return self._num_records + sum(len(r) for r in self._writing_records.values())

    @property
    def pending_requests(self) -> int:
        """Requests whose usage is not written yet: pending, or in the batch a flush is writing now."""
        return sum(p.requests for p in (*self._pending.values(), *self._writing.values()))

    async def flush(self) -> None:
        """Write everything pending now (on a worker thread); failed writes stay pending."""
        batch, self._pending = self._pending, {}
        records, self._records, self._num_records = self._records, {}, 0
        if batch or records:
            self._writing, self._writing_records = batch, records
            try:
                failed, failed_records = await asyncio.to_thread(self._write, batch, records)
            finally:
                self._writing, self._writing_records = {}, {}
            for (tenant_id, hour_start), counts in failed.items():
                self.add(tenant_id, hour_start, counts)
            for tenant_id, kept in failed_records.items():
                self.add_records(tenant_id, kept)

    async def close(self) -> None:
        """Stop the flusher (letting a flush in progress finish) and write what is pending."""
        self._closed = True
        self._closing.set()
        if self._flusher is not None:
            await self._flusher
            self._flusher = None
        await self.flush()

    async def _flush_every_interval(self) -> None:
        while not self._closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), self.flush_interval_s)
            await self.flush()

    def _write(self, batch: dict[tuple[str, float], UsageCounts], records: dict[str, list[RequestRecord]]
               ) -> tuple[dict[tuple[str, float], UsageCounts], dict[str, list[RequestRecord]]]:
        """Worker thread: write the counters, then the records; returns what failed (to keep pending)."""
        failed: dict[tuple[str, float], UsageCounts] = {}
        for (tenant_id, hour_start), c in batch.items():
            try:
                self.store.record_usage(tenant_id, hour_start, c.requests, c.prompt_tokens, c.completion_tokens,
                                        c.cached_tokens)
            except NotFoundError:
                log.warning("usage of tenant %s dropped: the tenant no longer exists", tenant_id)
            except Exception as e:
                log.error("could not record usage of tenant %s (kept for the next flush): %s", tenant_id, e)
                failed[(tenant_id, hour_start)] = c
        failed_records: dict[str, list[RequestRecord]] = {}
        for tenant_id, pending in records.items():
            try:
                self.store.record_requests(tenant_id, pending)
            except NotFoundError:
                log.warning("%d request records of tenant %s dropped: the tenant no longer exists", len(pending),
                            tenant_id)
            except Exception as e:
                log.error("could not write request records of tenant %s (kept for the next flush): %s", tenant_id, e)
                failed_records[tenant_id] = pending
        return failed, failed_records
