"""`BatchedUsageReporter`: final usage summed in memory and written to the store once a second, off the
request path (a UsageReporter, gateway/admission/base.py).

Semantics:
    report(tenant, usage)  adds 1 request and the usage's tokens to the pending totals of (tenant, UTC hour
                           now); no I/O, never awaits longer than a dict update.
    flusher                every `flush_interval_s` writes what is pending on a worker thread: one
                           `Store.record_usage` per (tenant, hour), stamped at that hour, so the hourly
                           counters are the same as with one write per request. A write that fails is
                           added back and retried at the next flush (logged).
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

from gateway.admission.base import FinalUsage
from gateway.store import Store, Tenant
from gateway.store.errors import NotFoundError
from gateway.store.usage_buckets import HOUR, floor_to

log = logging.getLogger(__name__)


@dataclass
class UsageCounts:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class BatchedUsageReporter:
    def __init__(self, store: Store, flush_interval_s: float = 1.0, clock: Callable[[], float] = time.time) -> None:
        if not 0 < flush_interval_s <= 60:
            raise ValueError(f"flush_interval_s must be in (0, 60], got {flush_interval_s}")
        self.store = store
        self.flush_interval_s = flush_interval_s
        self._clock = clock
        self._pending: dict[tuple[str, float], UsageCounts] = {}  # (tenant id, hour start) -> totals
        self._writing: dict[tuple[str, float], UsageCounts] = {}  # the batch a flush is writing now
        self._flusher: asyncio.Task | None = None
        self._closing = asyncio.Event()
        self._closed = False

    async def report(self, tenant: Tenant, usage: FinalUsage) -> None:
        self.add(tenant.id, floor_to(self._clock(), HOUR), UsageCounts(1, usage.prompt_tokens, usage.completion_tokens,
                                                                    usage.cached_tokens))
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

    @property
    def pending_requests(self) -> int:
        """Requests whose usage is not written yet: pending, or in the batch a flush is writing now."""
        return sum(p.requests for p in (*self._pending.values(), *self._writing.values()))

    async def flush(self) -> None:
        """Write everything pending now (on a worker thread); failed writes stay pending."""
        batch, self._pending = self._pending, {}
        if batch:
            self._writing = batch
            try:
                failed = await asyncio.to_thread(self._write, batch)
            finally:
                self._writing = {}
            for (tenant_id, hour_start), counts in failed.items():
                self.add(tenant_id, hour_start, counts)

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

    def _write(self, batch: dict[tuple[str, float], UsageCounts]) -> dict[tuple[str, float], UsageCounts]:
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
        return failed
