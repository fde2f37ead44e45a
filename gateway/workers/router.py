"""`RoutingEngineClient`: one `EngineClient` over several engine workers.

Each `generate` takes a snapshot of the healthy workers (load, resident adapters, the prompt's match in
this gateway's approximate prefix index), lets the `RoutingPolicy` pick one, counts the decision, records
the prompt in the index under that worker, and streams from it. A worker that cannot be reached before
anything ran (RequestError worker_unavailable) leaves the rotation and the request is routed again among
the others; one that fails mid-stream ends that request with its engine_error (nothing is replayed:
tokens were already sent) and is health-checked at once. With no healthy worker, worker_unavailable.

`state()` sums the healthy workers' states (the gateway's /metrics and dashboard show the fleet);
`healthy()` is true while any worker is in rotation. Enter `running()` for the app's lifetime (it polls).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Collection

from gateway.workers.client import EngineClient
from gateway.workers.prefix_index import PrefixIndex, page_hashes
from gateway.workers.registry import WorkerHandle, WorkerRegistry
from gateway.workers.routing_policy import (
    RouteRequest,
    RoutingConfig,
    RoutingDecision,
    RoutingPolicy,
    WorkerView,
)
from wire.errors import ErrorCode, RequestError
from wire.protocol import GenerateDelta, GenerateRequest, WorkerState


def index_namespace(request: GenerateRequest) -> str:
    """The request's prefix-cache namespace (wire.protocol.prefix_namespace: cache salt, adapter content)
    as the prefix index keys it: the engine's radix tree keys the same pair."""
    return "\x00".join(request.prefix_namespace)


class RoutingEngineClient(EngineClient):
    def __init__(self, registry: WorkerRegistry, config: RoutingConfig | None = None, *,
                 on_decision: Callable[[str], None] | None = None) -> None:
        """`on_decision(reason)` is called once per routing decision (the metrics counter)."""
        self.config = config or RoutingConfig()
        self.registry = registry
        self.policy = RoutingPolicy(self.config)
        self.index = PrefixIndex(self.config.prefix_index)
        self._on_decision = on_decision or (lambda reason: None)
        self._placement: dict[str, WorkerHandle] = {}  # request id -> worker running it
        registry.add_removal_listener(self.index.remove_worker)  # a worker out of rotation: forget its prefixes

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[RoutingEngineClient]:
        async with self.registry.polling():
            yield self

    def route(self, request: GenerateRequest, exclude: Collection[str] = ()) -> tuple[WorkerHandle, RoutingDecision]:
        """Choose a worker for `request` (not one in `exclude`). Raises RequestError(worker_unavailable)
        when none is healthy. Does not record anything."""
        healthy = [w for w in self.registry.healthy_workers() if w.worker_id not in exclude]
        if not healthy:
            raise RequestError(ErrorCode.WORKER_UNAVAILABLE, request_id=request.request_id)
        namespace, tokens = index_namespace(request), request.prompt_token_ids
        matches = self.index.match(namespace, tokens) if self.config.strategy == "cache_aware" else {}
        views = [WorkerView(w.worker_id, w.load, w.resident_adapters, matches.get(w.worker_id, 0)) for w in healthy]
        start = min(len(tokens), self.config.prefix_index.page_size)
        affinity_key = page_hashes(namespace, tokens[:start], start)[0]  # namespace and first page
        adapter = request.adapter.sha256 if request.adapter else None
        has_full_page = len(tokens) >= self.config.prefix_index.page_size
        decision = self.policy.choose(RouteRequest(len(tokens), adapter, affinity_key, has_full_page), views)
        return next(w for w in healthy if w.worker_id == decision.worker_id), decision

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        tried: set[str] = set()
        while True:
            worker, decision = self.route(request, tried)
            self._on_decision(decision.reason)
            self.index.insert(worker.worker_id, index_namespace(request), request.prompt_token_ids)
            if request.adapter is not None:
                worker.adapters_sent.add(request.adapter.sha256)
            worker.in_flight += 1
            self._placement[request.request_id] = worker
            deltas = worker.client.generate(request)
            started = False
            try:
                async for delta in deltas:
                    started = True
                    yield delta
                return
            except RequestError as e:
                if e.code is ErrorCode.WORKER_UNAVAILABLE and not started:  # nothing ran there: try another
                    self.registry.mark_unreachable(worker, e.message)
                    tried.add(worker.worker_id)
                    continue
                if e.code is ErrorCode.ENGINE_ERROR:
                    self.registry.check_soon(worker)
                raise
            finally:
                await deltas.aclose()  # type: ignore[attr-defined]
                self._placement.pop(request.request_id, None)
                await self.registry.release(worker)

    async def abort(self, request_id: str) -> None:
        worker = self._placement.get(request_id)
        if worker is not None:
            await worker.client.abort(request_id)

    async def state(self) -> WorkerState:
        states = [w.state for w in self.registry.healthy_workers() if w.state is not None]
        if not states:
            raise RequestError(ErrorCode.WORKER_UNAVAILABLE)
        return combined_state(states)

    async def healthy(self) -> bool:
        return bool(self.registry.healthy_workers())

    async def unload_adapter(self, sha256: str) -> None:
        """Every worker this gateway knows, in rotation or not, concurrently."""
        workers = self.registry.all_workers()
        for worker in workers:
            worker.adapters_sent.discard(sha256)
        await asyncio.gather(*(w.client.unload_adapter(sha256) for w in workers))

    async def close(self) -> None:
        await self.registry.close()


def combined_state(states: list[WorkerState]) -> WorkerState:
    """The fleet as one worker: counters and block counts summed, KV use over all blocks."""
    total_blocks = sum(s.num_kv_blocks for s in states)
    free_blocks = sum(s.num_free_kv_blocks for s in states)
    return WorkerState(
        num_running=sum(s.num_running for s in states), num_waiting=sum(s.num_waiting for s in states),
        num_kv_blocks=total_blocks, num_free_kv_blocks=free_blocks,
        kv_usage=(total_blocks - free_blocks) / total_blocks if total_blocks else 0.0,
        prefix_query_tokens=sum(s.prefix_query_tokens for s in states),
        prefix_hit_tokens=sum(s.prefix_hit_tokens for s in states),
        prefix_cache_blocks=sum(s.prefix_cache_blocks for s in states),
        resident_adapters=sorted({a for s in states for a in s.resident_adapters}),
        model=states[0].model,
        adapter_loads=sum(s.adapter_loads for s in states),
        adapter_evictions=sum(s.adapter_evictions for s in states),
    )
