"""The gateway's admission (the one `loraplex serve` builds: quota gate, then fair queue) end to end:
headers, 429s, budgets, errors, release on every outcome, failover."""

from __future__ import annotations

import asyncio
import math
import re
import time

import httpx
import pytest

from gateway.admission.settings import QuotaSettings
from tests.gateway.quota_stack import completion_body, in_process_gateway, start_null_worker, wait_null_worker

DURATION = re.compile(r"^(\d+ms|(\d+h)?(\d+m)?\d+(\.\d{1,3})?s)$")
RATE_HEADERS = [f"x-ratelimit-{kind}-{what}" for kind in ("limit", "remaining", "reset")
                for what in ("requests", "tokens")]


@pytest.fixture(scope="module")
def worker_url():
    worker, url = start_null_worker(token_delay_ms=2.0)
    wait_null_worker(worker, url)
    yield url
    worker.stop()


@pytest.fixture()
def gateway(llama_dir, tmp_path, worker_url):
    gw = in_process_gateway(llama_dir, tmp_path, worker_url, QuotaSettings(queue_capacity=4))
    yield gw
    gw.close()


def post(gw, key: str, body: dict) -> httpx.Response:
    return httpx.post(gw.url + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)


def check_retry_after(resp: httpx.Response) -> None:
    seconds, ms = int(resp.headers["retry-after"]), int(resp.headers["retry-after-ms"])
    assert ms >= 1 and seconds == max(1, math.ceil(ms / 1000))


def test_headers_on_success_and_on_429_are_consistent(gateway):
    key = gateway.new_tenant("hdr", {"requests_per_minute": 3, "tokens_per_minute": 1000})
    answers = [post(gateway, key, completion_body(4, 6)) for _ in range(4)]
    assert [r.status_code for r in answers] == [200, 200, 200, 429]
    for i, resp in enumerate(answers):
        assert all(h in resp.headers for h in RATE_HEADERS), resp.headers
        assert resp.headers["x-ratelimit-limit-requests"] == "3"
        assert resp.headers["x-ratelimit-limit-tokens"] == "1000"
        assert DURATION.match(resp.headers["x-ratelimit-reset-requests"]), resp.headers
        assert DURATION.match(resp.headers["x-ratelimit-reset-tokens"]), resp.headers
        assert int(resp.headers["x-ratelimit-remaining-requests"]) == max(0, 2 - i)
    assert int(answers[0].headers["x-ratelimit-remaining-tokens"]) == 1000 - 10
    refused = answers[3]
    check_retry_after(refused)
    assert refused.json()["error"] | {"message": ""} == {
        "message": "", "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}
    # One request refills in 20 s; the hint is never earlier than that window allows.
    assert 18_000 <= int(refused.headers["retry-after-ms"]) <= 20_000


def test_daily_budget_refuses_at_exactly_the_limit(gateway):
    key = gateway.new_tenant("budget", {"daily_token_budget": 100, "requests_per_minute": 1000})
    statuses = [post(gateway, key, completion_body(5, 20)).status_code for _ in range(4)]
    assert statuses == [200] * 4  # 4 x 25 = 100 = the budget
    refused = post(gateway, key, completion_body(1, 1))
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "insufficient_quota"
    assert refused.json()["error"]["type"] == "insufficient_quota"
    check_retry_after(refused)


def test_request_larger_than_the_tenant_allows_is_a_400(gateway):
    key = gateway.new_tenant("small", {"max_tokens_per_request": 50})
    resp = post(gateway, key, completion_body(10, 41))
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "request_too_large"
    assert post(gateway, key, completion_body(10, 40)).status_code == 200


def _settled(gw, tenant_id: str) -> tuple[int, int]:
    usage = asyncio.run(gw.quota.usage(tenant_id))
    return usage.in_flight, usage.day_tokens


def test_a_client_that_disconnects_mid_stream_releases_everything_once(gateway):
    key = gateway.new_tenant("gone", {"max_concurrent_requests": 1})
    tenant_id = gateway.store.list_tenants()[-1].id
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", gateway.url + "/v1/completions", headers={"authorization": f"Bearer {key}"},
            json=completion_body(4, 2000, stream=True)) as resp:
        assert resp.status_code == 200
        next(resp.iter_lines())
    deadline = time.monotonic() + 10
    while gateway.admission.queue.in_flight or _settled(gateway, tenant_id)[0]:
        assert time.monotonic() < deadline, "the disconnected request was never released"
        time.sleep(0.02)
    in_flight, day_tokens = _settled(gateway, tenant_id)
    assert 4 < day_tokens < 2004  # reconciled to what was served, not the 2004 reserved
    assert post(gateway, key, completion_body(4, 1)).status_code == 200  # the only slot is free again


def test_a_client_that_disconnects_while_queued_leaves_the_queue_at_once(llama_dir, tmp_path, worker_url):
    gw = in_process_gateway(llama_dir, tmp_path, worker_url, QuotaSettings(queue_capacity=1))
    try:
        key = gw.new_tenant("queued", {"max_concurrent_requests": 4})
        headers = {"authorization": f"Bearer {key}"}
        with httpx.Client(timeout=30) as holder, holder.stream(
                "POST", gw.url + "/v1/completions", headers=headers, json=completion_body(4, 4000, stream=True)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # NOTE: keep the iterator alive; dropping it closes the stream
            next(lines)  # the only worker slot is taken
            waiter = httpx.Client(timeout=0.5)
            with pytest.raises(httpx.ReadTimeout):  # queued behind the stream, then gives up
                waiter.post(gw.url + "/v1/completions", headers=headers, json=completion_body(4, 1))
            waiter.close()
            deadline = time.monotonic() + 2  # the stream ahead of it runs for 8 s
            while gw.admission.queue.waiting:
                assert time.monotonic() < deadline, "the abandoned request kept its place in the queue"
                time.sleep(0.02)
            assert gw.admission.queue.in_flight == 1  # the stream still holds its slot
    finally:
        gw.close()


def test_a_dead_worker_refunds_the_reservation(llama_dir, tmp_path):
    gw = in_process_gateway(llama_dir, tmp_path, "http://127.0.0.1:9", QuotaSettings(queue_capacity=2))  # no one there
    try:
        key = gw.new_tenant("orphan", {})
        tenant_id = gw.store.list_tenants()[-1].id
        resp = post(gw, key, completion_body(4, 6))
        assert resp.status_code == 503
        deadline = time.monotonic() + 5  # settled right after the answer is sent
        while _settled(gw, tenant_id) != (0, 0):
            assert time.monotonic() < deadline, _settled(gw, tenant_id)
            time.sleep(0.01)
        assert gw.admission.queue.in_flight == 0
    finally:
        gw.close()


def test_a_priority_is_refused_outside_the_range_and_a_queue_refusal_reports_the_refund(llama_dir, tmp_path,
                                                                                        worker_url):
    gw = in_process_gateway(llama_dir, tmp_path, worker_url, QuotaSettings(queue_capacity=1))
    try:
        key = gw.new_tenant("one-queued", {"max_priority": 4, "max_queued_requests": 0})
        refused = post(gw, key, completion_body(4, 6, priority=5))
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "priority_not_allowed"
        with httpx.Client(timeout=30) as holder, holder.stream(
                "POST", gw.url + "/v1/completions", headers={"authorization": f"Bearer {key}"},
                json=completion_body(4, 4000, stream=True)) as r:
            lines = r.iter_lines()  # NOTE: keep the iterator alive; dropping it closes the stream
            next(lines)  # the only worker slot is taken, and this tenant may queue nobody
            full = post(gw, key, completion_body(4, 6, priority=4))
            tenant_id = gw.store.list_tenants()[-1].id
            # the quota gate gave the refused request's reservation back: only the stream holds anything
            assert _settled(gw, tenant_id) == (1, 4004)
        assert full.status_code == 429 and full.json()["error"]["code"] == "rate_limit_exceeded"
        check_retry_after(full)
        assert int(full.headers["x-ratelimit-remaining-tokens"]) >= 100_000 - 4004  # as after the refund
        assert gw.admission.stats()["refused"] == {"priority": 1, "queue_full_tenant": 1}
    finally:
        gw.close()


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_redis_stopped_mid_test_fails_as_configured(llama_dir, tmp_path, worker_url, redis_server, mode):
    settings = QuotaSettings(queue_capacity=2, fail_mode=mode, redis_timeout_s=0.3)
    gw = in_process_gateway(llama_dir, tmp_path, worker_url, settings, redis_url=redis_server.url)
    try:
        key = gw.new_tenant("outage", {"requests_per_minute": 3})
        assert post(gw, key, completion_body(4, 2)).status_code == 200  # shared limit: 1 of 3 used
        redis_server.stop()
        answers = [post(gw, key, completion_body(4, 2)) for _ in range(4)]
        stats = gw.admission.stats()
        assert stats["quota_degraded"] and stats["quota_outages"] == 1
        if mode == "closed":
            assert [r.status_code for r in answers] == [503] * 4
            assert all(r.json()["error"]["code"] == "quota_unavailable" for r in answers)
            for r in answers:
                check_retry_after(r)
            assert stats["quota_refused_unavailable"] == 4
        else:  # local limits of this replica: a fresh bucket of 3
            assert [r.status_code for r in answers] == [200, 200, 200, 429]
            assert stats["quota_fallback_admissions"] == 4
    finally:
        gw.close()
