"""A worker's own `/metrics`: the model-server protocol's `vllm:*` gauges and loraplex's `loraplex_worker_*`.

The Gateway API Inference Extension's endpoint pickers (llm-d's router, GIE's reference picker) score a
model server by the gauges of the model-server protocol, so a worker that serves them can sit in an
`InferencePool` as it is. Values are computed at scrape time from one `WorkerState` (the engine loop's
latest snapshot, `WorkerService.state()`): a scrape never touches the engine, and every family of one
scrape describes the same moment.

    vllm:num_requests_running            gauge  sequences in the running batch
    vllm:num_requests_waiting            gauge  sequences queued for the batch
    vllm:kv_cache_usage_perc             gauge  fraction of KV blocks requests hold, 0..1 (blocks only the
                                                prefix cache holds count as free: they are evicted on demand)
    vllm:cache_config_info               gauge  1, labels block_size and num_gpu_blocks
    vllm:lora_requests_info              gauge  the scrape's unix time, labels max_lora and the comma-joined
                                                running_lora_adapters / waiting_lora_adapters
    vllm:lora_adapter_loaded             gauge  1 per adapter held in memory, labels adapter_name,
                                                level ("gpu": in a device slot, "cpu": host memory only),
                                                pinned ("true"/"false") and rank
    loraplex_worker_*                           loraplex's own: weights, KV blocks, prefix cache, adapter
                                                loads and evictions, preemptions, fault isolation,
                                                structured outputs checked and failed by the output guard,
                                                unknown formats ignored (label format), broken grammars

Adapter names are the worker's names for them, their sha256 (what `/state` lists and the gateway routes
by): tenants' own names stay in the gateway, so a scrape shows no tenant's adapter names.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from wire.protocol import WorkerState


class WorkerMetricsCollector(Collector):
    """Every family from one `state()` call per scrape. `clock` gives vllm:lora_requests_info's value."""

    def __init__(self, state: Callable[[], WorkerState], clock: Callable[[], float] = time.time) -> None:
        self._state = state
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        s = self._state()
        yield _gauge("vllm:num_requests_running", "Requests in the model execution batch.", s.num_running)
        yield _gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", s.num_waiting)
        yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.", s.kv_usage)

        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache configuration.",
                                 labels=["block_size", "num_gpu_blocks", "cache_dtype"])
        info.add_metric([str(s.block_size), str(s.num_kv_blocks), s.kv_cache_dtype], 1.0)
        yield info

        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        lora.add_metric([str(s.max_loras), ",".join(s.running_adapters), ",".join(s.waiting_adapters)],
                        self._clock())
        yield lora

        loaded = GaugeMetricFamily("vllm:lora_adapter_loaded",
                                   "1 for each LoRA adapter held in memory: level gpu in a device slot, cpu in host "
                                   "memory only.", labels=["adapter_name", "level", "pinned", "rank"])
        for a in s.adapter_residency:
            loaded.add_metric([a.name, a.level, "true" if a.pinned else "false", str(a.rank)], 1.0)
        yield loaded

        yield _gauge("loraplex_worker_weight_bytes", "Resident bytes of the base model's weights (packed when "
                     "quantized).", s.weight_bytes)
        yield _gauge("loraplex_worker_kv_blocks", "KV-cache blocks of this worker.", s.num_kv_blocks)
        yield _gauge("loraplex_worker_kv_cache_bytes", "Resident bytes of the KV cache.", s.kv_cache_bytes)
        yield _gauge("loraplex_worker_kv_free_blocks", "KV-cache blocks free now (blocks the prefix cache holds "
                     "are not free).", s.num_free_kv_blocks)
        yield _gauge("loraplex_worker_prefix_cache_blocks", "KV blocks held by the prefix cache.",
                     s.prefix_cache_blocks)
        yield _counter("loraplex_worker_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                       s.prefix_query_tokens)
        yield _counter("loraplex_worker_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                       s.prefix_hit_tokens)
        yield _gauge("loraplex_worker_adapters_loaded", "Adapters this worker serves without reading them again.",
                     len(s.resident_adapters))
        yield _counter("loraplex_worker_adapter_slot_loads", "Adapters copied into a device slot.", s.adapter_loads)
        yield _counter("loraplex_worker_adapter_slot_evictions", "Adapters evicted from a device slot to make room.",
                       s.adapter_evictions)
        yield _counter("loraplex_worker_adapter_host_loads", "Adapter directories read into host memory.",
                       s.adapter_host_loads)
        yield _counter("loraplex_worker_adapter_host_evictions", "Adapters dropped from host memory to make room.",
                       s.adapter_host_evictions)
        yield _counter("loraplex_worker_preemptions", "Requests preempted because the KV cache ran out.",
                       s.num_preemptions)
        yield _counter("loraplex_worker_prefix_waits", "Admissions put off a step while a running request computed "
                       "the prompt prefix they share (computed once, then read from the prefix cache).",
                       s.prefix_waits)
        yield _counter("loraplex_worker_faulted_steps", "Engine steps that raised and were re-run without the "
                       "requests at fault.", s.faulted_steps)
        yield _counter("loraplex_worker_isolated_request_failures", "Requests failed alone by a fault attributed "
                       "to them (their batch-mates kept their tokens).", s.isolated_failures)
        yield _counter("loraplex_worker_structured_outputs_checked", "Finished constrained outputs validated "
                       "against their schema before they were returned.", s.structured_checked)
        yield _counter("loraplex_worker_structured_output_guard_failures", "Finished constrained outputs that "
                       "failed validation (a grammar bug; the request got an error, never the output).",
                       s.structured_guard_failures)
        ignored = CounterMetricFamily("loraplex_worker_grammar_ignored_formats", "Schemas compiled with a "
                                      "`format` the backend does not know, kept as an annotation (per format).",
                                      labels=["format"])
        for name, count in sorted(s.grammar_ignored_formats.items()):
            ignored.add_metric([name], count)
        yield ignored
        yield _counter("loraplex_worker_grammar_broken_evicted", "Cached grammars dropped and compiled again "
                       "because a matcher found them broken.", s.grammar_broken_evicted)


def worker_metrics_registry(state: Callable[[], WorkerState]) -> CollectorRegistry:
    """A registry of its own per worker app (never the process-wide default one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerMetricsCollector(state))
    return registry


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
