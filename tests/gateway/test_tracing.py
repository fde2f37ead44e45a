"""One request through a real HTTP worker yields gateway and worker spans in one trace, linked parent →
child; a client's own traceparent is continued; nothing is exported without an endpoint."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider

from gateway.observability.tracing import (
    build_tracer_provider,
    otlp_traces_url,
    parent_from_traceparent,
    traceparent_of,
)
from tests.gateway.admin_stack import start_admin_stack
from tests.gateway.conftest import wait_until

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def stack(llama_dir, tmp_path_factory):
    stack = start_admin_stack(llama_dir, tmp_path_factory.mktemp("tracing"), http_worker=True)
    yield stack
    stack.stop()


def test_one_request_yields_a_linked_gateway_and_worker_span_tree(stack):
    stack.gateway_spans.clear()
    stack.worker_spans.clear()
    resp = stack.chat(stack.tenant_key, max_tokens=4, traceparent=f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01")
    assert resp.status_code == 200
    assert wait_until(lambda: len(stack.worker_spans.get_finished_spans()) == 3)
    assert wait_until(lambda: any(s.name.startswith("POST") for s in stack.gateway_spans.get_finished_spans()))
    gateway = {s.name: s for s in stack.gateway_spans.get_finished_spans()}
    worker = {s.name: s for s in stack.worker_spans.get_finished_spans()}
    assert set(worker) == {"worker.generate", "worker.prefill", "worker.decode"}
    assert {"POST /v1/chat/completions", "gateway.auth", "gateway.admission", "gateway.quota", "gateway.queue",
            "gateway.worker_call"} <= set(gateway)

    everything = list(gateway.values()) + list(worker.values())
    assert {format(s.context.trace_id, "032x") for s in everything} == {CLIENT_TRACE}

    def parent_of(name: str) -> str:
        span = gateway.get(name) or worker[name]
        owner = next(s for s in everything if s.context.span_id == span.parent.span_id)
        return owner.name

    root = gateway["POST /v1/chat/completions"]
    assert format(root.parent.span_id, "016x") == CLIENT_PARENT and root.parent.is_remote
    for child in ("gateway.auth", "gateway.admission", "gateway.worker_call"):
        assert parent_of(child) == root.name
    assert parent_of("gateway.quota") == parent_of("gateway.queue") == "gateway.admission"
    assert parent_of("worker.generate") == "gateway.worker_call" and worker["worker.generate"].parent.is_remote
    assert parent_of("worker.prefill") == parent_of("worker.decode") == "worker.generate"

    usage = resp.json()["usage"]
    call = gateway["gateway.worker_call"].attributes
    assert call["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert call["gen_ai.usage.output_tokens"] == 4 and call["loraplex.tenant"] == "acme"
    assert call["gen_ai.server.time_to_first_token"] > 0 and call["gen_ai.server.time_per_output_token"] > 0
    prefill = worker["worker.prefill"].attributes
    assert prefill["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert prefill["gen_ai.usage.cached_input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert prefill["loraplex.batch_size"] >= 1 and prefill["loraplex.adapter"] == ""
    assert worker["worker.decode"].attributes["gen_ai.usage.output_tokens"] == 4
    assert root.attributes["http.response.status_code"] == 200 and root.attributes["loraplex.tenant"] == "acme"
    assert gateway["gateway.auth"].attributes["loraplex.tenant"] == "acme"
    assert worker["worker.prefill"].end_time <= worker["worker.decode"].start_time


def test_a_refused_request_ends_at_admission_without_a_worker_call(stack):
    limited = stack.store.create_tenant("one-a-minute", policy={"requests_per_minute": 1})
    key, _ = stack.store.create_api_key(limited.id)
    stack.gateway_spans.clear()
    assert stack.chat(key).status_code == 200
    # The answer reaches the client just before its spans end: wait for them before starting afresh.
    assert wait_until(lambda: any(s.name.startswith("POST") for s in stack.gateway_spans.get_finished_spans()))
    stack.gateway_spans.clear()
    stack.worker_spans.clear()
    assert stack.chat(key).status_code == 429
    assert wait_until(lambda: any(s.name.startswith("POST") for s in stack.gateway_spans.get_finished_spans()))
    spans = {s.name: s for s in stack.gateway_spans.get_finished_spans()}
    assert "gateway.worker_call" not in spans and not stack.worker_spans.get_finished_spans()
    admission = spans["gateway.admission"]
    assert admission.status.is_ok is False and admission.attributes["loraplex.refusal.reason"] == "rate_limit"
    assert spans["POST /v1/chat/completions"].attributes["http.response.status_code"] == 429


def test_nothing_is_exported_without_an_endpoint_and_urls_are_checked():
    assert build_tracer_provider("svc") is None
    assert otlp_traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert otlp_traces_url("https://c.example/v1/traces") == "https://c.example/v1/traces"
    with pytest.raises(ValueError, match="OTLP endpoint"):
        otlp_traces_url("collector:4318")
    assert parent_from_traceparent("garbage") is None and parent_from_traceparent(None) is None
    provider = build_tracer_provider("svc", otlp_endpoint="http://127.0.0.1:9/v1/traces")
    assert isinstance(provider, TracerProvider)
    span = provider.get_tracer("t").start_span("s")
    assert traceparent_of(span).startswith("00-" + format(span.get_span_context().trace_id, "032x"))
    span.end()
    provider.shutdown()
