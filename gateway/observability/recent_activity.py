"""The last minutes of traffic in fixed time buckets, for the dashboard's overview charts.

Each bucket (default 5 s, 10 minutes kept) holds what happened in it: output tokens streamed, requests
finished and their prompt/cached tokens, refusals, first-token latencies, and samples of queue depth
and KV use. `series()` turns them into chart points; `requests_in_last(tenant, s)` feeds the tenants
table ("requests in the last minute" against the requests/min limit).

Not persistent and per gateway replica: it shows what this process saw. Thread-safe.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_TTFT_SAMPLES_PER_BUCKET = 2048


@dataclass
class _Bucket:
    start: float  # POSIX seconds, a multiple of the bucket width
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    requests: int = 0
    errors: int = 0
    refusals: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    queue_depth: int | None = None  # the largest sample taken in the bucket
    kv_usage: float | None = None  # the latest sample
    requests_by_tenant: dict[str, int] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


class RecentActivity:
    def __init__(self, bucket_s: float = 5.0, window_s: float = 600.0,
                 clock: Callable[[], float] = time.time) -> None:
        if bucket_s <= 0 or window_s < bucket_s:
            raise ValueError(f"need 0 < bucket_s <= window_s, got bucket_s={bucket_s}, window_s={window_s}")
        self.bucket_s = bucket_s
        self.num_buckets = int(math.ceil(window_s / bucket_s))
        self.clock = clock
        self._buckets: deque[_Bucket] = deque()
        self._lock = threading.Lock()

    # ---- recording --------------------------------------------------------------------------------

    def add_output_tokens(self, count: int) -> None:
        with self._lock:
            self._current().completion_tokens += count

    def add_first_token(self, ttft_s: float) -> None:
        with self._lock:
            bucket = self._current()
            if len(bucket.ttfts_s) < MAX_TTFT_SAMPLES_PER_BUCKET:
                bucket.ttfts_s.append(ttft_s)

    def add_finished(self, tenant: str, prompt_tokens: int, cached_tokens: int, ok: bool) -> None:
        with self._lock:
            bucket = self._current()
            bucket.requests += 1
            bucket.errors += 0 if ok else 1
            bucket.prompt_tokens += prompt_tokens
            bucket.cached_tokens += cached_tokens
            bucket.requests_by_tenant[tenant] = bucket.requests_by_tenant.get(tenant, 0) + 1

    def add_refusal(self, tenant: str) -> None:
        with self._lock:
            bucket = self._current()
            bucket.refusals += 1
            bucket.requests_by_tenant[tenant] = bucket.requests_by_tenant.get(tenant, 0) + 1

    def add_sample(self, queue_depth: int | None, kv_usage: float | None) -> None:
        with self._lock:
            bucket = self._current()
            if queue_depth is not None:
                bucket.queue_depth = max(bucket.queue_depth or 0, queue_depth)
            if kv_usage is not None:
                bucket.kv_usage = kv_usage

    # ---- reading ----------------------------------------------------------------------------------

    def series(self) -> list[dict[str, Any]]:
        """One point per bucket of the window, oldest first; buckets with no traffic are zeros, and
        values that need data (TTFT, hit ratio, samples) are None there."""
        with self._lock:
            self._current()
            by_start = {b.start: b for b in self._buckets}
            newest = self._buckets[-1].start
        points = []
        for i in range(self.num_buckets - 1, -1, -1):
            start = newest - i * self.bucket_s
            b = by_start.get(start) or _Bucket(start)
            p50, p95 = percentile(b.ttfts_s, 50), percentile(b.ttfts_s, 95)
            points.append({
                "t": start,
                "tokens_per_s": b.completion_tokens / self.bucket_s,
                "requests": b.requests,
                "errors": b.errors,
                "refusals": b.refusals,
                "ttft_p50_ms": None if p50 is None else p50 * 1000.0,
                "ttft_p95_ms": None if p95 is None else p95 * 1000.0,
                "cache_hit_ratio": b.cached_tokens / b.prompt_tokens if b.prompt_tokens else None,
                "queue_depth": b.queue_depth,
                "kv_usage": b.kv_usage,
            })
        return points

    def requests_in_last(self, seconds: float) -> dict[str, int]:
        """Requests (finished or refused) per tenant in the buckets overlapping the last `seconds`."""
        with self._lock:
            self._current()
            since = self.clock() - seconds
            out: dict[str, int] = {}
            for bucket in self._buckets:
                if bucket.start + self.bucket_s > since:
                    for tenant, n in bucket.requests_by_tenant.items():
                        out[tenant] = out.get(tenant, 0) + n
        return out

    def _current(self) -> _Bucket:
        """The bucket holding now (created, and old ones dropped, as time moves on). Lock held."""
        start = math.floor(self.clock() / self.bucket_s) * self.bucket_s
        if not self._buckets or self._buckets[-1].start < start:
            self._buckets.append(_Bucket(start))
        while self._buckets and self._buckets[0].start <= start - self.num_buckets * self.bucket_s:
            self._buckets.popleft()
        return self._buckets[-1]
