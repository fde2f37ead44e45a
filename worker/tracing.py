"""Worker-side spans of one generate request, continuing the gateway's trace from its `traceparent`.

    worker.generate   SERVER, child of the gateway's worker-call span (W3C trace context)
    ├── worker.prefill   from arrival to the first output tokens: prompt and cached tokens, adapter,
    │                    batch size (requests running in the engine per its latest stats snapshot)
    └── worker.decode    from the first output to the end: output tokens, largest batch size seen

With no tracer provider every call is a no-op. `build_tracer_provider` makes the worker's provider
(OTLP over HTTP to a collector). NOTE: worker/ never imports gateway/: the gateway has its own setup
(gateway/observability/tracing.py), under its own service name.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, StatusCode, TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from wire.protocol import GenerateDelta, GenerateRequest

INSTRUMENTATION_NAME = "loraplex.worker"
WORKER_SERVICE_NAME = "loraplex-worker"
OTLP_TRACES_PATH = "/v1/traces"


def build_tracer_provider(otlp_endpoint: str | None) -> SdkTracerProvider | None:
    """A provider exporting the worker's spans (batched) to an OTLP/HTTP collector, or None without one.
    `otlp_endpoint` is used as given when it ends in /v1/traces, else with that path appended (the
    convention of OTEL_EXPORTER_OTLP_ENDPOINT). The caller owns it: `shutdown()` flushes and stops it."""
    if not otlp_endpoint:
        return None
    endpoint = otlp_endpoint.strip()
    if not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"the OTLP endpoint must be an http:// or https:// URL, got {endpoint!r}")
    if not endpoint.rstrip("/").endswith(OTLP_TRACES_PATH):
        endpoint = endpoint.rstrip("/") + OTLP_TRACES_PATH
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    provider = SdkTracerProvider(resource=Resource.create({"service.name": WORKER_SERVICE_NAME}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


class RequestSpans:
    """The spans of one request. Call `on_delta` for every delta, then `finish` exactly once."""

    def __init__(self, tracer: trace.Tracer, request: GenerateRequest, model: str) -> None:
        parent = None
        if request.traceparent:
            parent = TraceContextTextMapPropagator().extract({"traceparent": request.traceparent})
        adapter = request.adapter.name if request.adapter else ""
        self.root = tracer.start_span("worker.generate", context=parent, kind=SpanKind.SERVER, attributes={
            "loraplex.request_id": request.request_id, "gen_ai.request.model": model,
            "loraplex.adapter": adapter, "loraplex.adapter_sha256": request.adapter.sha256 if request.adapter else "",
            "loraplex.priority": request.priority,
        })
        self._tracer = tracer
        self._context = trace.set_span_in_context(self.root)
        self.prefill: Span = tracer.start_span("worker.prefill", context=self._context, attributes={
            "gen_ai.usage.input_tokens": len(request.prompt_token_ids), "loraplex.adapter": adapter,
        })
        self.decode: Span | None = None
        self.output_tokens = 0
        self.max_batch = 0

    def on_delta(self, delta: GenerateDelta, batch_size: int) -> None:
        tokens = sum(len(s.token_ids) for s in delta.samples)
        # NOTE: `batch_size` comes from the engine's stats snapshot, which may predate the step that made
        # this delta; the step ran this request, so the batch held at least one.
        batch_size = max(1, batch_size)
        self.max_batch = max(self.max_batch, batch_size)
        if self.decode is None and (tokens or delta.finished):
            self.prefill.set_attribute("gen_ai.usage.cached_input_tokens", delta.num_cached_tokens)
            self.prefill.set_attribute("loraplex.batch_size", batch_size)
            self.prefill.end()
            self.decode = self._tracer.start_span("worker.decode", context=self._context)
        self.output_tokens += tokens

    def finish(self, error: str | None = None) -> None:
        if self.decode is None:
            self.prefill.end()
        else:
            self.decode.set_attribute("gen_ai.usage.output_tokens", self.output_tokens)
            self.decode.set_attribute("loraplex.max_batch_size", self.max_batch)
            self.decode.end()
        self.root.set_attribute("gen_ai.usage.output_tokens", self.output_tokens)
        if error is not None:
            self.root.set_status(StatusCode.ERROR, error)
        self.root.end()


class WorkerTracing:
    def __init__(self, provider: TracerProvider | None = None) -> None:
        self.enabled = provider is not None
        self.tracer = provider.get_tracer(INSTRUMENTATION_NAME) if provider is not None else trace.NoOpTracer()

    def request(self, request: GenerateRequest, model: str) -> RequestSpans | None:
        return RequestSpans(self.tracer, request, model) if self.enabled else None
