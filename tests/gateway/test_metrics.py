"""/metrics against a live gateway: it parses with prometheus_client's parser and its counters match the
traffic sent; tenant labels stay bounded."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability.metrics import OTHER_TENANTS, GatewayMetrics, ScrapeInputs, TenantLabeler
from gateway.observability.telemetry import TelemetryConfig
from tests.gateway.admin_stack import start_admin_stack
from tests.gateway.conftest import BASE_MODEL, wait_until


@pytest.fixture(scope="module")
def stack(llama_dir, tmp_path_factory):
    stack = start_admin_stack(llama_dir, tmp_path_factory.mktemp("metrics"),
                              telemetry_config=TelemetryConfig(max_tenant_labels=2))
    yield stack
    stack.stop()


def scrape(stack) -> dict[tuple[str, tuple], float]:
    resp = httpx.get(stack.url + "/metrics", headers=stack.admin_headers(), timeout=30)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counters_match_the_traffic_sent(stack):
    limited = stack.store.create_tenant("limited", policy={"requests_per_minute": 1})
    limited_key, _ = stack.store.create_api_key(limited.id)
    extra = stack.store.create_tenant("extra")
    extra_key, _ = stack.store.create_api_key(extra.id)

    usages = []
    for i in range(3):
        resp = stack.chat(stack.tenant_key, content=f"hello {i}", max_tokens=3)
        assert resp.status_code == 200
        usages.append(resp.json()["usage"])
    with httpx.stream("POST", stack.url + "/v1/chat/completions", timeout=60,
                      headers={"authorization": f"Bearer {stack.tenant_key}"},
                      json={"model": BASE_MODEL, "max_tokens": 3, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True},
                            "messages": [{"role": "user", "content": "hello 0"}]}) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: {")]
    usages.append(httpx.Response(200, content=lines[-1][len("data: "):]).json()["usage"])
    assert stack.chat(limited_key).status_code == 200
    refused = stack.chat(limited_key)
    assert refused.status_code == 429
    assert stack.chat(extra_key, max_tokens=2).status_code == 200
    assert stack.chat("lpx-" + "0" * 43).status_code == 401
    assert httpx.post(stack.url + "/v1/chat/completions", headers={"authorization": f"Bearer {stack.tenant_key}"},
                      json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}).status_code == 404

    requests = "loraplex_requests_total"
    # a request is counted once its response is done, which a client can see a moment before the server
    # records it (the last bytes of a stream): wait until all nine are in, then check every figure
    assert wait_until(lambda: sum(v for k, v in scrape(stack).items() if k[0] == requests) == 9)
    m = scrape(stack)
    assert value(m, requests, tenant="acme", model=BASE_MODEL, status="200") == 4
    assert value(m, requests, tenant="acme", model="-", status="404") == 1
    assert value(m, requests, tenant="limited", model=BASE_MODEL, status="200") == 1
    assert value(m, requests, tenant="limited", model="-", status="429") == 1
    assert value(m, requests, tenant=OTHER_TENANTS, model=BASE_MODEL, status="200") == 1  # 3rd tenant
    assert value(m, requests, tenant=OTHER_TENANTS, model="-", status="401") == 1  # anonymous is past the bound
    assert {dict(k[1]).get("tenant") for k in m if k[0] == requests} == {"acme", "limited", OTHER_TENANTS}

    tokens = "loraplex_tokens_total"
    assert value(m, tokens, tenant="acme", kind="completion") == 12
    assert value(m, tokens, tenant="acme", kind="prompt") == sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0 and value(m, tokens, tenant="acme", kind="cached") == cached
    assert value(m, tokens, tenant=OTHER_TENANTS, kind="completion") == 2

    served = 6  # acme 4, limited 1, extra 1
    for name in ("loraplex_time_to_first_token_seconds_count", "loraplex_e2e_request_latency_seconds_count"):
        assert value(m, name, model=BASE_MODEL) == served
    assert value(m, "loraplex_inter_token_latency_seconds_count", model=BASE_MODEL) == 4 * (3 - 1) + (4 - 1) + (2 - 1)
    assert value(m, "loraplex_time_to_first_token_seconds_bucket", model=BASE_MODEL, le="+Inf") == served
    assert value(m, "loraplex_queue_wait_seconds_count") == served
    assert value(m, "loraplex_quota_refusals_total", tenant="limited", reason="rate_limit") == 1

    assert value(m, "loraplex_worker_up") == 1
    assert 0.0 <= value(m, "loraplex_kv_cache_usage_ratio") <= 1.0
    assert value(m, "loraplex_worker_requests", state="running") == 0
    assert value(m, "loraplex_prefix_cache_queries_total") >= sum(u["prompt_tokens"] for u in usages)
    assert value(m, "loraplex_prefix_cache_hits_total") >= cached
    assert ("loraplex_adapter_loads_total", ()) in m and ("loraplex_adapter_evictions_total", ()) in m
    assert ("loraplex_tenant_queue_depth", ()) not in m  # only labelled samples, none while idle


def test_metrics_need_an_admin_key(stack):
    assert httpx.get(stack.url + "/metrics").status_code == 401
    tenant = httpx.get(stack.url + "/metrics", headers={"authorization": f"Bearer {stack.tenant_key}"})
    assert tenant.status_code == 403


def test_tenant_labels_are_bounded_and_stable():
    labeler = TenantLabeler(2)
    assert [labeler(t) for t in ("a", "b", "c", "a", OTHER_TENANTS, "d", "b")] == ["a", "b", OTHER_TENANTS, "a",
                                                                                  OTHER_TENANTS, OTHER_TENANTS, "b"]
    with pytest.raises(ValueError, match="max_tenant_labels"):
        TenantLabeler(-1)


def test_registries_are_per_app_and_worker_families_need_a_worker():
    one, two = GatewayMetrics(), GatewayMetrics()
    one.record_tokens("a", 5, 2, 1)
    text_two = two.render(ScrapeInputs(None, None)).decode()
    assert "loraplex_tokens_total{" not in text_two and "loraplex_worker_up 0.0" in text_two
    assert "loraplex_kv_cache_usage_ratio" not in text_two
    text_one = one.render(ScrapeInputs(None, None)).decode()
    assert 'loraplex_tokens_total{kind="prompt",tenant="a"} 5.0' in text_one
