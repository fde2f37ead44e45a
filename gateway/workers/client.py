"""How the gateway talks to engine workers: one interface, two transports.

`EngineClient.generate` yields `GenerateDelta`s until one is finished. A request that fails raises one
exception type whatever the transport, `wire.errors.RequestError`, whose `code` says what happened:
    invalid_request      the worker refused it as invalid (bad parameters, prompt longer than the context)
    adapter_unavailable  the adapter cannot be served there
    worker_unavailable   no worker could take it (not reachable, restarting): nothing ran
    engine_error         the worker failed or vanished mid-request
Closing the iterator early aborts the request in the engine.

`InProcessEngineClient` runs an AsyncLLM in this process (tests, embedded use); `HttpEngineClient`
(gateway/workers/http_client.py) talks to a worker subprocess or a remote host.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from wire.protocol import GenerateDelta, GenerateRequest, WorkerState


class EngineClient(ABC):
    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Stream deltas; raises RequestError (see the module docstring)."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort a running request (no error if it is unknown or finished)."""

    @abstractmethod
    async def state(self) -> WorkerState:
        """The worker's load and cache state; RequestError(worker_unavailable) when there is none."""

    @abstractmethod
    async def healthy(self) -> bool: ...

    @abstractmethod
    async def unload_adapter(self, sha256: str) -> None:
        """Tell the worker(s) to forget the adapter with this content (its last live record was deleted):
        its device slot and host memory are freed once the requests running on it end. Best effort: a
        worker that cannot be reached is skipped (logged); it gets no request for deleted content anyway,
        since the gateway resolves adapters from the store on every request."""

    async def close(self) -> None:
        return None


class InProcessEngineClient(EngineClient):
    """Over a `WorkerService` in this process (its AsyncLLM runs in its own thread). The service's deltas
    and RequestErrors pass through unchanged."""

    def __init__(self, service) -> None:  # worker.server.WorkerService
        self.service = service

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        deltas = self.service.generate(request)
        try:
            async for delta in deltas:
                yield delta
        finally:
            await deltas.aclose()

    async def abort(self, request_id: str) -> None:
        await self.service.abort(request_id)

    async def state(self) -> WorkerState:
        return self.service.state()

    async def healthy(self) -> bool:
        return True

    async def unload_adapter(self, sha256: str) -> None:
        await self.service.unload_adapter(sha256)
