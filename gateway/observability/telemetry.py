"""`Telemetry`: the metrics registry, tracer and recent-activity window of one gateway app.

`build_app` makes one (or takes one), puts it in lifespan state under "telemetry", wraps the API in
`TelemetryMiddleware` (a server span and the requests counter for every /v1/ call), wraps admission
(gateway/admission/instrumented.py) and lets each generation report through a `RequestObserver`
(gateway/observability/request_observer.py). While the app runs, a sampler records queue depth and KV use into the
activity window every `sample_interval_s`. Shutting down flushes and stops the tracer provider.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.observability.metrics import GatewayMetrics, QueueDepths, ScrapeInputs
from gateway.observability.tracing import (
    GATEWAY_SERVICE_NAME,
    build_tracer_provider,
    parent_from_traceparent,
    tracer_from,
)
from gateway.workers.client import EngineClient
from wire.protocol import WorkerState

log = logging.getLogger(__name__)

TELEMETRY_STATE_KEY = "telemetry"
REQUEST_TELEMETRY_KEY = "request_telemetry"
TRACED_PATH_PREFIX = "/v1/"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer started


@dataclass(frozen=True)
class TelemetryConfig:
    service_name: str = GATEWAY_SERVICE_NAME
    otlp_endpoint: str | None = None  # OTLP/HTTP collector; None = no export
    max_tenant_labels: int = 50  # tenants with their own metric label; later ones are "other"
    metrics_public: bool = False  # True: /metrics answers without a key (a private scrape network)
    activity_bucket_s: float = 5.0
    activity_window_s: float = 600.0
    sample_interval_s: float = 2.0  # queue depth / KV use samples for the overview charts
    worker_state_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if self.max_tenant_labels < 0:
            raise ValueError(f"max_tenant_labels must be >= 0, got {self.max_tenant_labels}")
        for name in ("activity_bucket_s", "sample_interval_s", "worker_state_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.activity_window_s < self.activity_bucket_s:
            raise ValueError("activity_window_s must be >= activity_bucket_s")


class Telemetry:
    def __init__(self, config: TelemetryConfig | None = None, *, span_exporters: Sequence[SpanExporter] = (),
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config or TelemetryConfig()
        self.metrics = GatewayMetrics(self.config.max_tenant_labels)
        self.provider = build_tracer_provider(self.config.service_name, self.config.otlp_endpoint, span_exporters)
        self.tracer = tracer_from(self.provider)
        self.activity = RecentActivity(self.config.activity_bucket_s, self.config.activity_window_s, clock)

    async def worker_state(self, engine: EngineClient) -> WorkerState | None:
        """The worker's state, or None when it does not answer in time (down, restarting)."""
        try:
            return await asyncio.wait_for(engine.state(), self.config.worker_state_timeout_s)
        except Exception as e:  # any failure means "no worker state right now"
            log.debug("worker state unavailable: %s", e)
            return None

    async def render_metrics(self, engine: EngineClient, queue: QueueDepths | None) -> bytes:
        return self.metrics.render(ScrapeInputs(await self.worker_state(engine), queue))

    @contextlib.asynccontextmanager
    async def running(self, engine: EngineClient, queue: QueueDepths | None) -> AsyncIterator[None]:
        """Samples queue depth and KV use while the app runs; flushes traces at the end."""
        async def sample_forever() -> None:
            while True:
                depth = sum(queue.depth_by_priority().values()) if queue is not None else None
                worker = await self.worker_state(engine)
                self.activity.add_sample(depth, worker.kv_usage if worker else None)
                await asyncio.sleep(self.config.sample_interval_s)

        task = asyncio.get_running_loop().create_task(sample_forever(), name="telemetry-sampler")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if self.provider is not None:
                self.provider.shutdown()


class RequestTelemetry:
    """Per-request labels the middleware reports when the response is done; the generation fills
    `model` and `outcome` (scope["state"][REQUEST_TELEMETRY_KEY])."""

    def __init__(self, telemetry: Telemetry, started: float) -> None:
        self.telemetry = telemetry
        self.started = started  # time.perf_counter() at arrival
        self.model = "-"  # "-" until admission (requests refused earlier have no resolved model)
        self.outcome: str | None = None


class TelemetryMiddleware:
    """Pure ASGI: for /v1/ requests, a SERVER span (continuing a client's traceparent) around the whole
    request and one `loraplex_requests_total{tenant, model, status}` increment when it is answered."""

    def __init__(self, app: ASGIApp, telemetry: Telemetry) -> None:
        self.app = app
        self.telemetry = telemetry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(TRACED_PATH_PREFIX):
            await self.app(scope, receive, send)
            return
        request = RequestTelemetry(self.telemetry, time.perf_counter())
        state = scope.setdefault("state", {})
        state[REQUEST_TELEMETRY_KEY] = request
        traceparent = _header(scope, b"traceparent")
        span = self.telemetry.tracer.start_span(
            f"{scope['method']} {scope['path']}", context=parent_from_traceparent(traceparent),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": scope["method"], "url.path": scope["path"],
                        "loraplex.request_id": str(state.get("request_id", ""))},
        )
        status: int | None = None

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False):
            try:
                await self.app(scope, receive, tracking_send)
            finally:
                if status is None:
                    status = CLIENT_CLOSED_REQUEST if request.outcome == "disconnected" else 500
                tenant = _tenant_name(scope)
                span.set_attribute("http.response.status_code", status)
                span.set_attribute("loraplex.tenant", tenant)
                span.set_attribute("gen_ai.request.model", request.model)
                if status >= 500:
                    span.set_status(StatusCode.ERROR)
                self.telemetry.metrics.record_request(tenant, request.model, status)


def _tenant_name(scope: Scope) -> str:
    user = scope.get("user")
    if user is not None and getattr(user, "is_authenticated", False):
        return str(user.display_name)
    return "anonymous"


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


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
    """The last minutes of traffic in fixed time buckets, for the dashboard's overview charts.

    Each bucket (default 5 s, 10 minutes kept) holds what happened in it: output tokens streamed, requests
    finished and their prompt/cached tokens, refusals, first-token latencies, and samples of queue depth
    and KV use. `series()` turns them into chart points; `requests_in_last(tenant, s)` feeds the tenants
    table ("requests in the last minute" against the requests/min limit).

    Not persistent and per gateway replica: it shows what this process saw. Thread-safe.
    """

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
