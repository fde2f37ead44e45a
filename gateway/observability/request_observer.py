"""`RequestObserver`: what one generation reports — latencies, tokens, and the worker-call span.

`GenerationResponse` makes one per request (when the app has telemetry): it opens the
`gateway.worker_call` span and hands the worker that span's `traceparent`, watches the engine's deltas
(first-token and inter-token latency, output tokens per second; O(1) per delta: it keeps counters and
two timestamps) and, at `finish`, records tokens, end-to-end latency and the span's GenAI attributes.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Protocol

from opentelemetry.trace import SpanKind, StatusCode
from starlette.types import Scope

from gateway.observability.telemetry import REQUEST_TELEMETRY_KEY, RequestTelemetry
from gateway.observability.tracing import traceparent_of
from gateway.store import Tenant
from wire.protocol import GenerateDelta, GenerateRequest


# NOTE: what the observer reads of gateway.admission.base's AdmissionRequest and FinalUsage, as protocols:
# admission is instrumented with this package (gateway/admission/instrumented.py), so it cannot import back.
class AdmissionRequest(Protocol):
    @property
    def tenant(self) -> Tenant: ...

    @property
    def model(self) -> str: ...


class FinalUsage(Protocol):
    @property
    def prompt_tokens(self) -> int: ...

    @property
    def completion_tokens(self) -> int: ...

    @property
    def cached_tokens(self) -> int: ...

    @property
    def outcome(self) -> str: ...


class RequestObserver:
    def __init__(self, request: RequestTelemetry, admission_request: AdmissionRequest,
                 engine_request: GenerateRequest) -> None:
        self.request = request
        self.telemetry = request.telemetry
        self.tenant = admission_request.tenant.name
        self.model = admission_request.model
        request.model = self.model
        adapter = engine_request.adapter
        self.span = self.telemetry.tracer.start_span("gateway.worker_call", kind=SpanKind.CLIENT, attributes={
            "gen_ai.operation.name": "chat", "gen_ai.request.model": self.model,
            "gen_ai.request.max_tokens": engine_request.sampling.max_tokens,
            "loraplex.tenant": self.tenant, "loraplex.request_id": engine_request.request_id,
            "loraplex.priority": engine_request.priority,
            "loraplex.adapter": adapter.name if adapter else "",
        })
        # The worker continues this span's trace; with tracing off the client's own traceparent passes.
        traceparent = traceparent_of(self.span) or engine_request.traceparent
        self.engine_request = replace(engine_request, traceparent=traceparent)
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.output_tokens = 0

    @classmethod
    def attach(cls, scope: Scope, admission_request: AdmissionRequest,
               engine_request: GenerateRequest) -> RequestObserver | None:
        """An observer for this request, or None when the app runs without telemetry."""
        request = scope.get("state", {}).get(REQUEST_TELEMETRY_KEY)
        if not isinstance(request, RequestTelemetry):
            return None
        return cls(request, admission_request, engine_request)

    async def watch(self, deltas: AsyncIterator[GenerateDelta]) -> AsyncIterator[GenerateDelta]:
        """`deltas`, observed. Closing this iterator closes `deltas` (which aborts the request)."""
        try:
            async for delta in deltas:
                self.on_delta(delta)
                yield delta
        finally:
            await deltas.aclose()  # type: ignore[attr-defined]

    def on_delta(self, delta: GenerateDelta) -> None:
        tokens = sum(len(s.token_ids) for s in delta.samples)
        if tokens == 0:
            return
        now = time.perf_counter()
        metrics, activity = self.telemetry.metrics, self.telemetry.activity
        if self.first_token_at is None:
            self.first_token_at = now
            ttft = now - self.request.started
            metrics.ttft.labels(self.model).observe(ttft)
            activity.add_first_token(ttft)
            self.span.set_attribute("gen_ai.server.time_to_first_token", ttft)
        elif self.last_token_at is not None:
            per_token = (now - self.last_token_at) / tokens
            histogram = metrics.inter_token.labels(self.model)
            for _ in range(tokens):
                histogram.observe(per_token)
        self.last_token_at = now
        self.output_tokens += tokens
        activity.add_output_tokens(tokens)

    def finish(self, usage: FinalUsage) -> None:
        """Once, when the request is over (whatever the outcome)."""
        now = time.perf_counter()
        self.request.outcome = usage.outcome
        metrics, activity = self.telemetry.metrics, self.telemetry.activity
        metrics.e2e.labels(self.model).observe(now - self.request.started)
        metrics.record_tokens(self.tenant, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        activity.add_finished(self.tenant, usage.prompt_tokens, usage.cached_tokens, usage.outcome == "ok")
        span = self.span
        span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
        span.set_attribute("gen_ai.usage.cached_input_tokens", usage.cached_tokens)
        span.set_attribute("loraplex.outcome", usage.outcome)
        if self.first_token_at is not None and usage.completion_tokens > 1 and self.last_token_at is not None:
            tpot = (self.last_token_at - self.first_token_at) / (usage.completion_tokens - 1)
            span.set_attribute("gen_ai.server.time_per_output_token", tpot)
        if usage.outcome == "error":
            span.set_status(StatusCode.ERROR, "the engine failed the request")
        span.end()
