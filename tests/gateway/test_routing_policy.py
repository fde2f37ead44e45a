"""The routing policy's decisions, one rule at a time, over snapshots of healthy workers."""

from __future__ import annotations

import pytest

from gateway.workers.routing_policy import RouteRequest, RoutingConfig, RoutingPolicy, WorkerView

ADAPTER = "a" * 64


def view(worker_id: str, load: int = 0, adapters: tuple[str, ...] = (), matched: int = 0) -> WorkerView:
    return WorkerView(worker_id, load, frozenset(adapters), matched)


def request(prompt_len: int = 100, adapter: str | None = None, key: bytes = b"k", full_page: bool = True):
    return RouteRequest(prompt_len, adapter, key, full_page)


def choose(workers, req=None, **config):
    return RoutingPolicy(RoutingConfig(**config)).choose(req or request(), workers)


def test_a_single_healthy_worker_is_chosen_as_only_healthy():
    decision = choose([view("w1", load=50)])
    assert (decision.worker_id, decision.reason) == ("w1", "only_healthy")


def test_prefix_affinity_above_the_threshold_and_not_below():
    workers = [view("w1", load=1), view("w2", load=0, matched=64)]
    decision = choose(workers, request(prompt_len=100), cache_threshold=0.5)
    assert (decision.worker_id, decision.reason) == ("w2", "prefix_affinity")
    below = choose([view("w1", load=0), view("w2", load=0, matched=32)], request(prompt_len=100),
                   cache_threshold=0.5)
    assert below.reason == "prefix_hash"


def test_adapter_residency_wins_when_no_prefix_matches():
    workers = [view("w1", load=0), view("w2", load=2, adapters=(ADAPTER,)), view("w3", load=1, adapters=(ADAPTER,))]
    decision = choose(workers, request(adapter=ADAPTER))
    assert (decision.worker_id, decision.reason) == ("w3", "adapter_resident")  # least loaded of the resident


def test_imbalance_falls_back_to_the_least_loaded_worker():
    hot = [view("w1", load=10, matched=96), view("w2", load=5)]
    decision = choose(hot, request(prompt_len=100), balance_abs_threshold=4, balance_rel_threshold=1.5)
    assert (decision.worker_id, decision.reason) == ("w2", "imbalance_fallback")
    # 10 vs 7: only 3 more (not > 4): still affinity; 10 vs 5 with rel 3: not 3x: still affinity
    assert choose([view("w1", 10, matched=96), view("w2", 7)], request(100)).reason == "prefix_affinity"
    assert choose(hot, request(100), balance_rel_threshold=3.0).reason == "prefix_affinity"


def test_prefix_hash_home_is_stable_and_spreads_prompts():
    workers = [view("w1"), view("w2"), view("w3")]
    homes = {choose(workers, request(key=f"prompt-{i}".encode())).worker_id for i in range(40)}
    assert homes == {"w1", "w2", "w3"}  # different prefixes spread
    for i in range(5):  # and one prefix always has the same home, whatever the order or the gateway
        key = f"prompt-{i}".encode()
        assert choose(workers, request(key=key)) == choose(list(reversed(workers)), request(key=key))


def test_short_prompts_go_to_the_least_loaded():
    decision = choose([view("w1", load=3), view("w2", load=1)], request(prompt_len=5, full_page=False))
    assert (decision.worker_id, decision.reason) == ("w2", "least_loaded")


def test_round_robin_and_least_loaded_strategies():
    workers = [view("w2", load=0, matched=100), view("w1", load=5)]
    policy = RoutingPolicy(RoutingConfig(strategy="round_robin"))
    assert [policy.choose(request(), workers).worker_id for _ in range(4)] == ["w1", "w2", "w1", "w2"]
    least = choose([view("w1", load=5, matched=100), view("w2", load=1)], strategy="least_loaded")
    assert (least.worker_id, least.reason) == ("w2", "least_loaded")


def test_no_workers_is_an_error():
    with pytest.raises(ValueError, match="at least one"):
        choose([])


@pytest.mark.parametrize("overrides,message", [
    ({"strategy": "random"}, "routing strategy"), ({"cache_threshold": 0.0}, "cache_threshold"),
    ({"balance_abs_threshold": -1}, "balance_abs_threshold"), ({"balance_rel_threshold": 0.5}, "balance_rel"),
])
def test_config_rejects_nonsense(overrides, message):
    with pytest.raises(ValueError, match=message):
        RoutingConfig(**overrides)
