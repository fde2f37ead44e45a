"""How the gateway talks to engine workers: one interface, two transports.

`EngineClient.generate` yields `GenerateDelta`s until one is finished, and raises:
    WorkerRequestError      the worker refused the request as invalid (answer 400)
    AdapterUnavailableError the adapter cannot be served there (answer 503 with a clear message)
    WorkerUnavailableError  no worker could take it (not reachable, restarting): nothing ran (answer 503)
    WorkerFailedError       the worker failed or vanished mid-request (answer 500 / an error event)
Closing the iterator early aborts the request in the engine.

`InProcessEngineClient` runs an AsyncLLM in this process (tests, embedded use); `HttpEngineClient`
(gateway/workers/http_client.py) talks to a worker subprocess or a remote host.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import NoReturn

from wire.protocol import (
    ADAPTER_UNAVAILABLE,
    INVALID_REQUEST,
    GenerateDelta,
    GenerateError,
    GenerateRequest,
    WorkerState,
)


class EngineClientError(Exception):
    pass


class WorkerRequestError(EngineClientError):
    """The request can never run as asked (bad parameters, prompt longer than the context)."""


class AdapterUnavailableError(EngineClientError):
    pass


class WorkerUnavailableError(EngineClientError):
    """No worker accepted the request; it did not start."""


class WorkerFailedError(EngineClientError):
    """The request started but the worker failed or went away."""


class EngineClient(ABC):
    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Stream deltas (see the module docstring for the errors)."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort a running request (no error if it is unknown or finished)."""

    @abstractmethod
    async def state(self) -> WorkerState: ...

    @abstractmethod
    async def healthy(self) -> bool: ...

    async def close(self) -> None:
        return None


def raise_for_error(message: GenerateError, started: bool) -> NoReturn:
    """Turn a worker's GenerateError message into the matching client exception."""
    if message.code == INVALID_REQUEST and not started:
        raise WorkerRequestError(message.message)
    if message.code == ADAPTER_UNAVAILABLE:
        raise AdapterUnavailableError(message.message)
    raise WorkerFailedError(message.message)


class InProcessEngineClient(EngineClient):
    """Over a `WorkerService` in this process (its AsyncLLM runs in its own thread)."""

    def __init__(self, service) -> None:  # worker.server.WorkerService
        self.service = service

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        started = False
        messages = self.service.generate(request)
        try:
            async for message in messages:
                if isinstance(message, GenerateError):
                    raise_for_error(message, started)
                started = True
                yield message
        finally:
            await messages.aclose()

    async def abort(self, request_id: str) -> None:
        await self.service.abort(request_id)

    async def state(self) -> WorkerState:
        return self.service.state()

    async def healthy(self) -> bool:
        return True
