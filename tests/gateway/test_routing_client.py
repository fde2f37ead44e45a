"""RoutingEngineClient over real worker services (the null engine in process) and a worker that is gone."""

from __future__ import annotations

import asyncio

import pytest

from demo.null_worker import NULL_CAPABILITIES, NullEngineConfig, NullLLM
from gateway.observability.metrics import GatewayMetrics
from gateway.workers.client import InProcessEngineClient
from gateway.workers.http_client import HttpEngineClient
from gateway.workers.registry import RegistryConfig, WorkerRegistry
from gateway.workers.router import RoutingEngineClient
from gateway.workers.routing_policy import RoutingConfig
from tests.conftest import free_port
from wire.errors import ErrorCode, RequestError
from wire.protocol import GenerateRequest
from wire.sampling import SamplingParams
from worker.server import WorkerService


def make_request(i: int, prompt: list[int], max_tokens: int = 3, salt: str = "tenant-a") -> GenerateRequest:
    return GenerateRequest(f"req-{i}", prompt, SamplingParams(max_tokens=max_tokens), cache_salt=salt)


def decisions(metrics: GatewayMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value("loraplex_routing_decisions_total", {"reason": reason}) or 0.0


class Fleet:
    """Null-engine workers in this process, addressed by made-up URLs, plus optional real HTTP clients."""

    def __init__(self, names: list[str], token_delay_s: float = 0.0, http: dict[str, str] | None = None) -> None:
        self.llms = {f"http://{n}": NullLLM(NullEngineConfig(token_delay_s=token_delay_s)) for n in names}
        self.http = http or {}

    def client_for(self, url: str):
        if url in self.llms:
            return InProcessEngineClient(WorkerService(self.llms[url], "null-model", NULL_CAPABILITIES))
        return HttpEngineClient(url, "secret", connect_timeout_s=1.0)

    def router(self, strategy: str = "cache_aware", **registry) -> tuple[RoutingEngineClient, GatewayMetrics]:
        metrics = GatewayMetrics()
        reg = WorkerRegistry(self.client_for, urls=[*self.llms, *self.http.values()],
                             config=RegistryConfig(**registry))
        return RoutingEngineClient(reg, RoutingConfig(strategy=strategy),
                                   on_decision=metrics.record_routing_decision), metrics


async def run(router: RoutingEngineClient, request: GenerateRequest) -> list:
    return [d async for d in router.generate(request)]


def worker_of(router: RoutingEngineClient, fleet: Fleet, request_id: str) -> str:
    return next(url for url, llm in fleet.llms.items() if any(rid == request_id for rid, _ in llm.started))


def test_a_repeated_prefix_goes_back_to_its_worker_and_decisions_are_counted():
    fleet = Fleet(["w1", "w2"])
    router, metrics = fleet.router()
    shared = list(range(1, 65))

    async def scenario() -> None:
        async with router.running():
            for i in range(6):
                deltas = await run(router, make_request(i, shared + [100 + i] * 16))
                assert deltas[-1].finished
            await run(router, make_request(99, [5] * 4))  # shorter than a page: least loaded

    asyncio.run(scenario())
    workers = {worker_of(router, fleet, f"req-{i}") for i in range(6)}
    assert len(workers) == 1  # all six share 64 of 80 tokens with the first
    assert decisions(metrics, "prefix_hash") == 1 and decisions(metrics, "prefix_affinity") == 5
    assert decisions(metrics, "least_loaded") == 1


def test_loads_count_requests_in_flight_and_closing_early_releases_them():
    fleet = Fleet(["w1", "w2"], token_delay_s=0.01)
    router, _ = fleet.router(strategy="least_loaded")

    async def scenario() -> None:
        async with router.running():
            streams = [router.generate(make_request(i, [i + 1] * 20, max_tokens=1000)) for i in range(4)]
            for s in streams:
                await anext(s)
            loads = sorted(w.load for w in router.registry.all_workers())
            assert loads == [2, 2]  # least loaded alternates between the two
            for s in streams:
                await s.aclose()
            assert [w.in_flight for w in router.registry.all_workers()] == [0, 0]
            state = await router.state()
            assert state.model == "null-model" and state.num_running == 0

    asyncio.run(scenario())


def test_an_unreachable_worker_leaves_the_rotation_and_the_request_runs_elsewhere():
    dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    fleet = Fleet(["w-live"], http={"dead": dead_url})
    router, metrics = fleet.router(strategy="round_robin")

    async def scenario() -> None:
        async with router.running():
            dead = next(w for w in router.registry.all_workers() if w.worker_id == dead_url)
            assert not dead.healthy  # the first poll found it down
            dead.healthy = True  # as if it died right after a successful poll
            deltas = await run(router, make_request(0, [1] * 32))  # round robin tries the dead one first
            assert deltas[-1].finished
            assert not dead.healthy and dead.in_flight == 0
            await run(router, make_request(1, [2] * 32))

    asyncio.run(scenario())
    assert decisions(metrics, "round_robin") == 1 and decisions(metrics, "only_healthy") == 2  # the retry, the next
    assert [rid for rid, _ in fleet.llms["http://w-live"].started] == ["req-0", "req-1"]


def test_polls_take_a_worker_out_after_repeated_failures_and_forget_its_prefixes():
    dead_url = f"http://127.0.0.1:{free_port()}"
    fleet = Fleet(["w1"], http={"dead": dead_url})
    router, _ = fleet.router(unhealthy_after=2, poll_interval_s=60)

    async def scenario() -> None:
        await router.registry.refresh()
        dead = next(w for w in router.registry.all_workers() if w.worker_id == dead_url)
        dead.healthy, dead.failed_polls = True, 0
        router.index.insert(dead_url, "ns", list(range(32)))
        await router.registry.refresh()
        assert dead.healthy and router.index.match("ns", list(range(32))) == {dead_url: 32}
        await router.registry.refresh()
        assert not dead.healthy and router.index.match("ns", list(range(32))) == {}
        assert await router.healthy()  # w1 still is
        await router.close()

    asyncio.run(scenario())


def test_no_healthy_worker_is_worker_unavailable():
    fleet = Fleet([], http={"dead": f"http://127.0.0.1:{free_port()}"})
    router, _ = fleet.router()

    async def scenario() -> None:
        async with router.running():
            assert not await router.healthy()
            with pytest.raises(RequestError) as generating:
                await run(router, make_request(0, [1] * 32))
            with pytest.raises(RequestError) as state:
                await router.state()
            assert generating.value.code is state.value.code is ErrorCode.WORKER_UNAVAILABLE

    asyncio.run(scenario())


def test_registry_rejects_duplicate_and_malformed_urls():
    with pytest.raises(ValueError, match="twice"):
        WorkerRegistry(lambda url: None, urls=["http://a:1", "http://a:1/"])  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="http:// or https://"):
        WorkerRegistry(lambda url: None, urls=["a:1"])  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="worker URLs or a (Redis )?directory"):
        WorkerRegistry(lambda url: None)  # type: ignore[arg-type,return-value]
