"""OpenTelemetry tracing: one TracerProvider per gateway app, W3C trace context to the worker.

A gateway request yields this span tree (names are stable; attributes follow the GenAI conventions):

    POST /v1/chat/completions        SERVER  http.*, loraplex.tenant, x-request-id
    ├── gateway.auth                 INTERNAL  loraplex.tenant, loraplex.key_id
    ├── gateway.admission            INTERNAL  priority or the refusal status/code
    │   ├── gateway.quota            INTERNAL  (reconstructed from the queue ticket's wait)
    │   └── gateway.queue            INTERNAL  loraplex.queue.wait_s
    └── gateway.worker_call          CLIENT    gen_ai.usage.*, gen_ai.server.time_to_first_token, ...
        └── worker.generate          SERVER    (in the worker, from the traceparent it was sent)
            ├── worker.prefill                gen_ai.usage.input_tokens, cached tokens, adapter, batch size
            └── worker.decode                 gen_ai.usage.output_tokens, batch size

Nothing is exported unless an OTLP endpoint (OTLP over HTTP) or an exporter is configured; then the
provider is a no-op one and a client's incoming traceparent is still passed through to the worker.
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.authentication import AuthCredentials, AuthenticationBackend, AuthenticationError, BaseUser
from starlette.requests import HTTPConnection

OTLP_TRACES_PATH = "/v1/traces"
GATEWAY_SERVICE_NAME = "loraplex-gateway"  # the worker's: worker/tracing.py
INSTRUMENTATION_NAME = "loraplex"


def otlp_traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector: `endpoint` as given if it ends in /v1/traces, else
    with that path appended (the convention of OTEL_EXPORTER_OTLP_ENDPOINT)."""
    endpoint = endpoint.strip()
    if not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"the OTLP endpoint must be an http:// or https:// URL, got {endpoint!r}")
    if endpoint.rstrip("/").endswith(OTLP_TRACES_PATH):
        return endpoint
    return endpoint.rstrip("/") + OTLP_TRACES_PATH


def build_tracer_provider(service_name: str, otlp_endpoint: str | None = None,
                          exporters: Sequence[SpanExporter] = ()) -> TracerProvider | None:
    """A provider exporting to an OTLP/HTTP collector (batched) and to `exporters` (synchronously, for
    tests); None when neither is configured. The caller owns it: `shutdown()` flushes and stops it."""
    if not otlp_endpoint and not exporters:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_traces_url(otlp_endpoint))))
    for exporter in exporters:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def tracer_from(provider: TracerProvider | None) -> Tracer:
    """The provider's tracer, or a no-op tracer (spans cost nothing and carry the parent's context)."""
    if provider is None:
        return trace.NoOpTracer()
    return provider.get_tracer(INSTRUMENTATION_NAME)


def parent_from_traceparent(traceparent: str | None) -> Context | None:
    """The context a W3C `traceparent` value names, or None when absent or malformed."""
    if not traceparent:
        return None
    context = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def traceparent_of(span: Span) -> str | None:
    """The W3C `traceparent` that makes a remote span a child of `span` (None for an invalid span)."""
    if not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")


class TracedAuthBackend(AuthenticationBackend):
    """Wraps an authentication backend in a `gateway.auth` span (status error when it refuses)."""

    def __init__(self, inner: AuthenticationBackend, tracer: Tracer) -> None:
        self.inner = inner
        self.tracer = tracer

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, BaseUser] | None:
        with self.tracer.start_as_current_span("gateway.auth", kind=SpanKind.INTERNAL,
                                               record_exception=False, set_status_on_exception=True) as span:
            try:
                result = await self.inner.authenticate(conn)
            except AuthenticationError as e:
                span.set_attribute("loraplex.auth.error", str(e))
                raise
            if result is not None:
                credentials, user = result
                span.set_attribute("loraplex.tenant", user.display_name)
                span.set_attribute("loraplex.key_id", user.identity)
                span.set_attribute("loraplex.auth.scopes", list(credentials.scopes))
            return result
