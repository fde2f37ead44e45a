"""`EngineClient` over HTTP: NDJSON streaming from one worker (worker/server.py).

Connection failures before the response starts are WorkerUnavailableError (nothing ran); a stream
that breaks or ends without a finished delta is WorkerFailedError. Leaving the stream early closes the
connection, which the worker takes as an abort; an explicit /abort is sent as well.

`generate` goes through gateway/workers/http_pool.py (kept-alive connections, a pool whose cost does not grow
with its size): a finished stream is read to its end (the worker ends it right after the finished delta)
before that delta is handed on, so its connection goes back to the pool. The rare calls (abort, state,
health) use httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator

import anyio
import httpx

from gateway.workers.client import (
    EngineClient,
    WorkerFailedError,
    WorkerRequestError,
    WorkerUnavailableError,
    raise_for_error,
)
from gateway.workers.http_pool import PoolConfig, WorkerConnectError, WorkerHttpPool, WorkerProtocolError
from wire.protocol import (
    TRACEPARENT_HEADER,
    WORKER_SECRET_HEADER,
    GenerateDelta,
    GenerateError,
    GenerateRequest,
    ProtocolError,
    WorkerState,
    parse_message,
)

log = logging.getLogger(__name__)

STREAM_END_GRACE_S = 1.0  # how long a finished stream may take to end before its connection is dropped


class HttpEngineClient(EngineClient):
    """One worker over HTTP. `transport` (httpx) serves abort, state and health; generate always uses
    the kept-alive pool of gateway/workers/http_pool.py."""

    def __init__(self, base_url: str, secret: str, *, connect_timeout_s: float = 5.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        # No read timeout on streams: a long queue wait is not a failure; a dead worker closes the socket.
        timeout = httpx.Timeout(connect=connect_timeout_s, read=None, write=30.0, pool=30.0)
        self._http = httpx.AsyncClient(base_url=self.base_url, headers={WORKER_SECRET_HEADER: secret},
                                       timeout=timeout, transport=transport)
        self._streams = WorkerHttpPool(self.base_url, {WORKER_SECRET_HEADER: secret},
                                       PoolConfig(connect_timeout_s=connect_timeout_s))
        self._background: set[asyncio.Task] = set()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        headers = {TRACEPARENT_HEADER: request.traceparent} if request.traceparent else {}
        body = json.dumps(request.to_json(), separators=(",", ":")).encode()
        started = finished = False
        resp = None
        try:
            resp = await self._streams.request("POST", "/generate", body, headers)
            if resp.status == 400:
                raise WorkerRequestError(_error_text(await resp.read()))
            if resp.status != 200:
                raise WorkerUnavailableError(f"worker answered HTTP {resp.status}")
            lines = resp.lines()
            async for line in lines:
                if not line:
                    continue
                message = parse_message(line)
                if isinstance(message, GenerateError):
                    raise_for_error(message, started)
                started = True
                finished = message.finished
                if finished:  # NOTE: before the yield: the consumer stops pulling after this delta
                    await _read_to_end(lines)
                yield message
                if finished:
                    return
        except WorkerConnectError as e:
            raise WorkerUnavailableError(f"engine worker at {self.base_url} is not reachable ({e})") from None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, UnicodeDecodeError,
                WorkerProtocolError, ProtocolError) as e:
            raise WorkerFailedError(f"connection to the engine worker broke: {type(e).__name__}") from None
        finally:
            if resp is not None:
                resp.close()  # back to the pool when read to the end, else closed (the worker aborts)
            if started and not finished:
                self._abort_in_background(request.request_id)
        if not finished:
            raise WorkerFailedError("the engine worker closed the stream before the request finished")

    async def abort(self, request_id: str) -> None:
        try:
            await self._http.post("/abort", json={"request_id": request_id}, timeout=5.0)
        except httpx.HTTPError as e:
            log.debug("abort of %s not delivered: %s", request_id, e)

    async def state(self) -> WorkerState:
        try:
            resp = await self._http.get("/state", timeout=5.0)
            resp.raise_for_status()
        except httpx.HTTPError as e:
            raise WorkerUnavailableError(f"worker state unavailable: {e}") from None
        return WorkerState.from_json(resp.json())

    async def healthy(self) -> bool:
        try:
            resp = await self._http.get("/health", timeout=2.0)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self._streams.aclose()
        await self._http.aclose()

    def _abort_in_background(self, request_id: str) -> None:
        try:
            task = asyncio.get_running_loop().create_task(self.abort(request_id))
        except RuntimeError:
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def _read_to_end(lines: AsyncIterator[str]) -> None:
    """Consume what is left of a finished stream so its connection can be reused (dropped if it lingers)."""
    with anyio.move_on_after(STREAM_END_GRACE_S), contextlib.suppress(OSError, asyncio.IncompleteReadError,
                                                                      WorkerProtocolError):
        async for _ in lines:  # a tail that breaks changes nothing: the request already finished
            pass


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:500]
