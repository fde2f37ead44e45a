"""Prometheus metrics of one gateway app, in its own CollectorRegistry (never the global default one).

Request-path metrics are recorded as requests happen; queue depth and the worker's state (KV use,
running/waiting, prefix-cache and adapter counters) are read at scrape time by `render`, so /metrics
always shows the present. Names follow vLLM's where one exists, with the `loraplex_` prefix.

Tenant labels are bounded: the first `max_tenant_labels` tenants seen keep their own name, every later
one is reported as "other". Labels never change once given, so counters stay monotonic per series.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from wire.protocol import WorkerState

OTHER_TENANTS = "other"
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds. First-token and end-to-end buckets span a tiny CPU model up to long generations.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

TOKEN_KINDS = ("prompt", "completion", "cached")


class QueueDepths(Protocol):
    """What /metrics and the admin API read from the admission queue (policies.FairQueue has it)."""

    def depth_by_priority(self) -> dict[int, int]: ...

    def depth_by_tenant(self) -> dict[str, int]: ...


class TenantLabeler:
    """Tenant name → label value: the first `limit` names get their own label, later ones "other"."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"max_tenant_labels must be >= 0, got {limit}")
        self.limit = limit
        self._named: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant: str) -> str:
        with self._lock:
            if tenant in self._named:
                return tenant
            if len(self._named) < self.limit and tenant != OTHER_TENANTS:
                self._named.add(tenant)
                return tenant
        return OTHER_TENANTS


@dataclass(frozen=True)
class ScrapeInputs:
    """What is read fresh at each scrape; None when that part is not available (no queue, worker down)."""

    worker: WorkerState | None
    queue: QueueDepths | None


class _LiveCollector(Collector):
    """Emits queue and worker families from the inputs handed to `GatewayMetrics.render`."""

    def __init__(self, labeler: TenantLabeler) -> None:
        self.labeler = labeler
        self.inputs = ScrapeInputs(None, None)

    def collect(self) -> Iterator[Metric]:
        worker, queue = self.inputs.worker, self.inputs.queue
        up = GaugeMetricFamily("loraplex_worker_up", "1 if the engine worker answered the scrape's state call.")
        up.add_metric([], 1.0 if worker is not None else 0.0)
        yield up
        if queue is not None:
            by_priority = GaugeMetricFamily("loraplex_queue_depth", "Requests waiting in the admission queue.",
                                            labels=["priority"])
            for priority, depth in sorted(queue.depth_by_priority().items()):
                by_priority.add_metric([str(priority)], float(depth))
            yield by_priority
            by_tenant = GaugeMetricFamily("loraplex_tenant_queue_depth", "Requests waiting, by tenant.",
                                          labels=["tenant"])
            summed: dict[str, int] = {}
            for tenant, depth in queue.depth_by_tenant().items():
                label = self.labeler(tenant)
                summed[label] = summed.get(label, 0) + depth
            for label, depth in sorted(summed.items()):
                by_tenant.add_metric([label], float(depth))
            yield by_tenant
        if worker is None:
            return
        yield _gauge("loraplex_kv_cache_usage_ratio", "Fraction of KV blocks in use (0..1).", worker.kv_usage)
        reqs = GaugeMetricFamily("loraplex_worker_requests", "Requests in the engine, by state.", labels=["state"])
        reqs.add_metric(["running"], float(worker.num_running))
        reqs.add_metric(["waiting"], float(worker.num_waiting))
        yield reqs
        yield _gauge("loraplex_prefix_cache_blocks", "KV blocks held by the prefix cache.",
                     worker.prefix_cache_blocks)
        yield _counter("loraplex_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                       worker.prefix_query_tokens)
        yield _counter("loraplex_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                       worker.prefix_hit_tokens)
        yield _gauge("loraplex_resident_adapters", "Adapters loaded in the worker.", len(worker.resident_adapters))
        yield _counter("loraplex_adapter_loads", "Adapters copied into a device slot.", worker.adapter_loads)
        yield _counter("loraplex_adapter_evictions", "Resident adapters replaced to make room.",
                       worker.adapter_evictions)
        yield _gauge("loraplex_model_weight_bytes", "Resident bytes of the base model's weights (packed when quantized).",
                     worker.weight_bytes)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    family.add_metric([], float(value))
    return family


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc)
    family.add_metric([], float(value))
    return family


class GatewayMetrics:
    """Every gateway metric, registered in `self.registry`. Thread-safe (prometheus_client is)."""

    def __init__(self, max_tenant_labels: int = 50) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.tenant_label = TenantLabeler(max_tenant_labels)
        r = self.registry
        self.requests = Counter("loraplex_requests", "API requests answered, by tenant, model and HTTP status.",
                                ["tenant", "model", "status"], registry=r)
        self.tokens = Counter("loraplex_tokens", "Tokens by tenant and kind (prompt, completion, cached prompt).",
                              ["tenant", "kind"], registry=r)
        self.ttft = Histogram("loraplex_time_to_first_token_seconds", "Admission to first token.",
                              ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.inter_token = Histogram("loraplex_inter_token_latency_seconds",
                                     "Time between successive output tokens of a request.",
                                     ["model"], buckets=INTER_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("loraplex_e2e_request_latency_seconds", "Request start to its last byte.",
                             ["model"], buckets=E2E_BUCKETS, registry=r)
        self.queue_wait = Histogram("loraplex_queue_wait_seconds",
                                    "Time a request spent in admission (quota check and queue).",
                                    buckets=QUEUE_WAIT_BUCKETS, registry=r)
        self.refusals = Counter("loraplex_quota_refusals", "Requests refused at admission, by tenant and reason.",
                                ["tenant", "reason"], registry=r)
        self.routing_decisions = Counter("loraplex_routing_decisions",
                                         "Requests routed to an engine worker, by the reason for the choice.",
                                         ["reason"], registry=r)
        self._live = _LiveCollector(self.tenant_label)
        r.register(self._live)
        self._render_lock = threading.Lock()

    # ---- recording (request path) -----------------------------------------------------------------

    def record_request(self, tenant: str, model: str, status: int) -> None:
        self.requests.labels(self.tenant_label(tenant), model or "-", str(status)).inc()

    def record_tokens(self, tenant: str, prompt: int, completion: int, cached: int) -> None:
        label = self.tenant_label(tenant)
        for kind, count in zip(TOKEN_KINDS, (prompt, completion, cached), strict=True):
            if count:
                self.tokens.labels(label, kind).inc(count)

    def record_refusal(self, tenant: str, reason: str) -> None:
        self.refusals.labels(self.tenant_label(tenant), reason).inc()

    def record_routing_decision(self, reason: str) -> None:
        """One request routed (gateway/workers/routing_policy.py DECISION_REASONS; a handful of label values)."""
        self.routing_decisions.labels(reason).inc()

    # ---- exposition -------------------------------------------------------------------------------

    def render(self, inputs: ScrapeInputs) -> bytes:
        """The text exposition, with queue and worker families taken from `inputs`."""
        with self._render_lock:
            self._live.inputs = inputs
            return generate_latest(self.registry)
