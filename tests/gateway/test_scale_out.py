"""Scale-out on loopback: one redis-server, two real engine workers (tiny random model, heartbeating
into Redis) and two `loraplex serve --discover-workers` gateways.

A multi-tenant workload with shared prefixes is sent through both gateways, once with cache-aware
routing and once with round robin (fresh tenants each time, so the two runs never share cache
namespaces); the prefix hit ratio comes from the engine itself (usage.prompt_tokens_details.cached_tokens).
Then a tenant's request quota holds exactly across both gateways.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from gateway.store import open_store
from tests.gateway.scale_out_stack import completion, post_all, start_gateways, start_stack

pytestmark = pytest.mark.slow

TENANTS = 3
PREFIXES_PER_TENANT = 2
ROUNDS = 4
PREFIX_TOKENS = 64  # four 16-token KV blocks
SUFFIX_TOKENS = 16


@pytest.fixture(scope="module")
def stack(make_model, tmp_path_factory):
    model = make_model("llama")
    root = tmp_path_factory.mktemp("scale-out")
    stack = start_stack(model, root)
    try:
        yield stack, model, root
    finally:
        stack.stop()


def shared_prefix_workload(run: str, keys: list[str]) -> list[tuple[int, str, list[int]]]:
    """(tenant index, key, prompt) in send order: every round asks every (tenant, prefix) once, each time
    with a new suffix. Token ids stay inside the tiny vocabulary."""
    calls = []
    for r in range(ROUNDS):
        for t, key in enumerate(keys):
            for p in range(PREFIXES_PER_TENANT):
                prefix = [(7 * p + 3 * t + i) % 200 + 20 for i in range(PREFIX_TOKENS)]
                suffix = [(11 * r + 5 * p + i) % 200 + 20 for i in range(SUFFIX_TOKENS)]
                calls.append((t, key, prefix + suffix))
    return calls


def run_workload(stack, model, root, routing: str) -> tuple[float, dict[str, float]]:
    gateways = start_gateways(stack, model, root, routing)
    store = open_store(stack.redis_url)
    try:
        keys = [store.create_api_key(store.create_tenant(f"{routing}-t{t}").id)[0] for t in range(TENANTS)]
        admin = store.create_api_key(store.create_tenant(f"{routing}-ops").id, scopes={"admin"})[0]
        calls = shared_prefix_workload(routing, keys)
        requests = [(gateways[i % 2].url, key, completion(prompt)) for i, (_, key, prompt) in enumerate(calls)]
        responses = asyncio.run(post_all(requests, concurrency=1))
        assert [r.status_code for r in responses] == [200] * len(calls), [r.text for r in responses][:3]
        prompt = sum(r.json()["usage"]["prompt_tokens"] for r in responses)
        cached = sum(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses)
        decisions = {}
        for g in gateways:
            for line in httpx.get(g.url + "/metrics", headers={"authorization": f"Bearer {admin}"}).text.splitlines():
                if line.startswith("loraplex_routing_decisions_total{"):
                    reason = line.split('reason="')[1].split('"')[0]
                    decisions[reason] = decisions.get(reason, 0) + float(line.rsplit(" ", 1)[1])
        return cached / prompt, decisions
    finally:
        for g in gateways:
            g.stop()
            stack.gateways.remove(g)
        store.close()


def test_cache_aware_routing_beats_round_robin_on_prefix_hits(stack, capsys):
    stack, model, root = stack
    started = time.monotonic()
    cache_aware, ca_decisions = run_workload(stack, model, root, "cache_aware")
    round_robin, rr_decisions = run_workload(stack, model, root, "round_robin")
    with capsys.disabled():
        print(f"\nprefix hit ratio: cache_aware={cache_aware:.3f} round_robin={round_robin:.3f} "
              f"({TENANTS} tenants x {PREFIXES_PER_TENANT} prefixes x {ROUNDS} rounds, two gateways, two workers, "
              f"{time.monotonic() - started:.1f}s)\nrouting decisions: cache_aware={ca_decisions} "
              f"round_robin={rr_decisions}")
    assert cache_aware > round_robin + 0.1, (cache_aware, round_robin)
    requests = TENANTS * PREFIXES_PER_TENANT * ROUNDS
    assert sum(ca_decisions.values()) == requests and sum(rr_decisions.values()) == requests
    assert set(rr_decisions) == {"round_robin"}
    assert ca_decisions.get("prefix_affinity", 0) > 0 and ca_decisions.get("prefix_hash", 0) > 0


def test_request_quota_is_exact_across_both_gateways(stack):
    stack, model, root = stack
    gateways = start_gateways(stack, model, root, "cache_aware")
    store = open_store(stack.redis_url)
    try:
        # 10 a minute refills one request every 6 s: the flood below ends well before that.
        tenant = store.create_tenant("flood", policy={"requests_per_minute": 10, "max_concurrent_requests": 100})
        key = store.create_api_key(tenant.id)[0]
        calls = [(gateways[i % 2].url, key, completion(list(range(20, 36)), max_tokens=1)) for i in range(30)]
        started = time.monotonic()
        responses = asyncio.run(post_all(calls, concurrency=30, spacing_s=0.02))  # alternating gateways
        # the bucket refills one request per 6 s: on a slow machine the flood may outlast a refill, and each
        # refill admits exactly one more. Limits kept per gateway would admit 10 on each (20 in all).
        refills = int((time.monotonic() - started) // 6.0)
        statuses = [r.status_code for r in responses]
        admitted = statuses.count(200)
        assert 10 <= admitted <= 10 + refills and statuses.count(429) == 30 - admitted, statuses
    finally:
        for g in gateways:
            g.stop()
            stack.gateways.remove(g)
        store.close()
