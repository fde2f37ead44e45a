"""`EngineClient` over HTTP: NDJSON streaming from one worker (worker/server.py).

Every failure is a `wire.errors.RequestError`: the worker's own error line as it sent it; a connection
that fails before the response starts is worker_unavailable (nothing ran); a stream that breaks or ends
without a finished delta is engine_error. The cause (worker URL, socket error) is logged here, once;
tenants see only the code's message. Leaving the stream early closes the connection, which the worker
takes as an abort; an explicit /abort is sent as well.

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

from gateway.workers.client import EngineClient
from gateway.workers.http_pool import PoolConfig, WorkerConnectError, WorkerHttpPool, WorkerProtocolError
from wire.errors import ErrorCode, RequestError
from wire.protocol import (
    TRACEPARENT_HEADER,
    WORKER_SECRET_HEADER,
    GenerateDelta,
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
        rid = request.request_id
        started = finished = False
        resp = None
        try:
            resp = await self._streams.request("POST", "/generate", body, headers)
            if resp.status == 400:  # the worker refused the request as it was sent
                raise self._refusal(rid, await resp.read())
            if resp.status != 200:
                log.warning("worker %s answered HTTP %d to generate %s", self.base_url, resp.status, rid)
                raise RequestError(ErrorCode.WORKER_UNAVAILABLE, request_id=rid)
            lines = resp.lines()
            async for line in lines:
                if not line:
                    continue
                message = parse_message(line)
                if isinstance(message, RequestError):
                    raise message
                started = True
                finished = message.finished
                if finished:  # NOTE: before the yield: the consumer stops pulling after this delta
                    await _read_to_end(lines)
                yield message
                if finished:
                    return
        except WorkerConnectError as e:
            log.warning("worker %s not reachable for %s: %.200s", self.base_url, rid, e)
            raise RequestError(ErrorCode.WORKER_UNAVAILABLE, request_id=rid) from None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, UnicodeDecodeError,
                WorkerProtocolError, ProtocolError) as e:
            log.warning("stream of %s from worker %s broke: %s: %.200s", rid, self.base_url, type(e).__name__, e)
            raise RequestError(ErrorCode.ENGINE_ERROR, request_id=rid) from None
        finally:
            if resp is not None:
                resp.close()  # back to the pool when read to the end, else closed (the worker aborts)
            if started and not finished:
                self._abort_in_background(rid)
        if not finished:
            log.warning("worker %s ended the stream of %s before it finished", self.base_url, rid)
            raise RequestError(ErrorCode.ENGINE_ERROR, request_id=rid)

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
            raise RequestError(ErrorCode.WORKER_UNAVAILABLE, f"worker state unavailable: {type(e).__name__}") from e
        return WorkerState.from_json(resp.json())

    async def healthy(self) -> bool:
        try:
            resp = await self._http.get("/health", timeout=2.0)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def unload_adapter(self, sha256: str) -> None:
        try:
            resp = await self._http.post("/adapters/unload", json={"sha256": sha256}, timeout=10.0)
            resp.raise_for_status()
        except httpx.HTTPError as e:
            log.warning("worker %s was not told to unload adapter %s: %s", self.base_url, sha256[:12], e)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self._streams.aclose()
        await self._http.aclose()

    def _refusal(self, request_id: str, body: bytes) -> RequestError:
        """The error line of a 400 answer (what the worker found wrong with the request)."""
        try:
            message = parse_message(body)
        except ProtocolError:
            message = None
        if isinstance(message, RequestError):
            return message
        log.warning("worker %s refused %s: %.200r", self.base_url, request_id, body)
        return RequestError(ErrorCode.INVALID_REQUEST, request_id=request_id)

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

