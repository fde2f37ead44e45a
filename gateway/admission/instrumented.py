"""`InstrumentedAdmission`: any RequestAdmission, with its spans, refusals and queue wait recorded.

Spans: `gateway.admission` around admit(); when the grant waited in a queue (`Admitted.queue_wait_s`,
set by GatedAdmission's fair-queue gate), its two phases become children `gateway.quota` and
`gateway.queue`, timed from that wait. Refusals (any ApiError from admit) count in
`loraplex_quota_refusals_total{tenant, reason}` with the reason named from the error's status and code.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry.trace import SpanKind, StatusCode

from gateway.admission.base import AdmissionRequest, Admitted, FinalUsage, RequestAdmission
from gateway.http.errors import ApiError
from gateway.observability.telemetry import Telemetry
from policies import FairQueue

# (status, error code) → refusal reason label (bounded); anything else is "other".
REFUSAL_REASONS = {
    (429, "rate_limit_exceeded"): "rate_limit",
    (429, "insufficient_quota"): "budget",
    (503, "quota_unavailable"): "quota_unavailable",
    (503, "service_unavailable"): "queue",
    (400, "request_too_large"): "request_too_large",
    (400, "priority_not_allowed"): "priority_not_allowed",
}


def refusal_reason(error: ApiError) -> str:
    return REFUSAL_REASONS.get((error.status, error.code or ""), "other")


class InstrumentedAdmission:
    def __init__(self, inner: RequestAdmission, telemetry: Telemetry) -> None:
        self.inner = inner
        self.telemetry = telemetry

    @property
    def queue(self) -> FairQueue | None:
        return self.inner.queue

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    async def close(self) -> None:
        await self.inner.close()

    async def admit(self, request: AdmissionRequest) -> Admitted:
        tracer, metrics = self.telemetry.tracer, self.telemetry.metrics
        tenant = request.tenant.name
        started_ns, started = time.time_ns(), time.perf_counter()
        with tracer.start_as_current_span("gateway.admission", kind=SpanKind.INTERNAL, record_exception=False,
                                          set_status_on_exception=False) as span:
            span.set_attribute("loraplex.tenant", tenant)
            span.set_attribute("loraplex.prompt_tokens", request.prompt_tokens)
            try:
                admitted = await self.inner.admit(request)
            except ApiError as e:
                reason = refusal_reason(e)
                span.set_status(StatusCode.ERROR, e.message)
                span.set_attribute("loraplex.refusal.status", e.status)
                span.set_attribute("loraplex.refusal.reason", reason)
                metrics.record_refusal(tenant, reason)
                self.telemetry.activity.add_refusal(tenant)
                raise
            ended_ns, elapsed = time.time_ns(), time.perf_counter() - started
            span.set_attribute("loraplex.priority", admitted.priority)
            waited = admitted.queue_wait_s
            metrics.queue_wait.observe(waited if waited is not None else elapsed)
            if waited is not None:
                split_ns = max(started_ns, ended_ns - int(waited * 1e9))
                tracer.start_span("gateway.quota", start_time=started_ns).end(end_time=split_ns)
                queue_span = tracer.start_span("gateway.queue", start_time=split_ns,
                                               attributes={"loraplex.queue.wait_s": waited})
                queue_span.end(end_time=ended_ns)
        return admitted

    async def release(self, request: AdmissionRequest, admitted: Admitted, usage: FinalUsage) -> None:
        await self.inner.release(request, admitted, usage)
