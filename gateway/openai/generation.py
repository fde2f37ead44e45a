"""Runs one admitted generation and answers it: a JSON body, or SSE chunks ending in `data: [DONE]`.

The answer is an ASGI response that watches for the client going away the whole time (while queued,
while waiting for the first token, mid-stream); then it closes the engine stream, which aborts the
request in the worker. Whatever happens, admission is released and usage reported exactly once.
Errors before the first byte are proper statuses; after it, one `data: {"error": ...}` event. Either way
a failure is the worker clients' one `RequestError`, answered through its code's one table entry
(wire/errors.py: status, OpenAI type, retry-after): the tenant sees the code and its short message
(for a server-side failure, the code's own message only: never exception text or an address).

A streamed answer keeps only counters per chunk; a non-streamed one collects the text it returns.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.admission.base import (
    AdmissionRequest,
    Admitted,
    FinalUsage,
    RequestAdmission,
    RequestLabels,
    UsageReporter,
)
from gateway.http.errors import ApiError
from gateway.observability.request_observer import RequestObserver
from gateway.openai.fanout import merge_deltas
from gateway.openai.format import Collected, Formatter, StreamCounters
from gateway.workers.client import EngineClient
from wire.errors import ErrorCode, RequestError
from wire.protocol import GenerateDelta, GenerateRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Generation:
    admission_request: AdmissionRequest
    admitted: Admitted
    engine_request: GenerateRequest
    formatter: Formatter
    n: int  # choices in the answer (every prompt's samples)
    stream: bool
    include_usage: bool
    more_requests: tuple[GenerateRequest, ...] = ()  # the other prompts of a completions prompt list
    labels: RequestLabels | None = None  # for the request's usage record


def api_error_for(error: RequestError) -> ApiError:
    """The OpenAI-shaped answer to a failed request: its code's status and type, the code itself.

    NOTE: a server-side failure (5xx) answers with its code's fixed message only, whatever text came with
    it (a worker's exception text, an address): that text goes to the log, once, bounded by RequestError."""
    code = error.code
    headers = {"retry-after": str(code.retry_after_s)} if code.retry_after_s else None
    message = error.message
    if code.http_status >= 500 and message != code.default_message:
        log.warning("request %s failed with %s: %s", error.request_id or "-", code.value, message)
        message = code.default_message
    return ApiError(code.http_status, message, param=error.param, code=code.value,
                    error_type=code.openai_type, headers=headers)


class GenerationResponse(Response):
    def __init__(self, generation: Generation, engine: EngineClient, admission: RequestAdmission,
                 usage: UsageReporter) -> None:
        super().__init__(content=None)
        self.generation = generation
        self.engine = engine
        self.admission = admission
        self.usage_reporter = usage
        self.counters = Collected(generation.n) if not generation.stream else StreamCounters(generation.n)
        self.outcome = "error"
        self.final_usage = FinalUsage(0, 0, 0, "error")  # set by _finish

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        generation = self.generation
        requests = (generation.engine_request, *generation.more_requests)
        observer = RequestObserver.attach(scope, generation.admission_request, generation.engine_request)
        if observer is not None:  # the worker gets the worker-call span's traceparent
            requests = tuple(replace(r, traceparent=observer.engine_request.traceparent) for r in requests)
        deltas = merge_deltas([self.engine.generate(r) for r in requests], generation.n // len(requests),
                              generation.engine_request.request_id)
        if observer is not None:  # deltas are timed on the way
            deltas = observer.watch(deltas)
        try:
            async with anyio.create_task_group() as tg:
                async def answer() -> None:
                    try:
                        await self._answer(deltas, send)
                    except OSError:  # the client went away while we were writing
                        self.outcome = "disconnected"
                    tg.cancel_scope.cancel()

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    # NOTE: the server reports a disconnect as soon as the answer is complete, which may
                    # be before `answer` cancels this task: a complete answer stays "ok".
                    if self.outcome != "ok":
                        self.outcome = "disconnected"
                    tg.cancel_scope.cancel()

                tg.start_soon(answer)
                tg.start_soon(watch)
        finally:
            with anyio.CancelScope(shield=True):
                await self._finish(deltas)
                if observer is not None:
                    observer.finish(self.final_usage)

    async def _answer(self, deltas: AsyncIterator[GenerateDelta], send: Send) -> None:
        try:
            first = await _next_delta(deltas)
        except RequestError as e:
            error = api_error_for(e)
            await _send_json(send, error.status, error.body(), error.headers)
            return
        if self.generation.stream:
            await self._stream(first, deltas, send)
        else:
            await self._collect(first, deltas, send)

    async def _collect(self, first: GenerateDelta | None, deltas: AsyncIterator[GenerateDelta], send: Send) -> None:
        collected = self.counters
        assert isinstance(collected, Collected)
        try:
            delta = first
            while delta is not None:
                collected.add(delta)
                delta = None if delta.finished else await _next_delta(deltas)
        except RequestError as e:
            error = api_error_for(e)
            await _send_json(send, error.status, error.body(), error.headers)
            return
        self.outcome = "ok"
        body = self.generation.formatter.response(collected)
        await _send_json(send, 200, body, self.generation.admitted.headers)

    async def _stream(self, first: GenerateDelta | None, deltas: AsyncIterator[GenerateDelta], send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
        headers += [(k.encode(), v.encode()) for k, v in self.generation.admitted.headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        formatter, include_usage, counters = self.generation.formatter, self.generation.include_usage, self.counters
        try:
            delta = first
            while delta is not None:
                counters.add(delta)
                chunk = formatter.chunk(delta, counters, include_usage)
                if chunk is not None:
                    await _send_event(send, chunk)
                delta = None if delta.finished else await _next_delta(deltas)
        except RequestError as e:
            await _send_event(send, api_error_for(e).body())
        else:
            self.outcome = "ok"
            if include_usage:
                await _send_event(send, formatter.usage_chunk(counters))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _finish(self, deltas: AsyncIterator[GenerateDelta]) -> None:
        try:
            await deltas.aclose()  # type: ignore[attr-defined]
        except Exception:
            log.exception("closing the engine stream failed")
        c = self.counters
        usage = self.final_usage = FinalUsage(c.prompt_tokens, c.completion_tokens, c.cached_tokens, self.outcome,
                                              c.finish_reasons)
        try:
            await self.admission.release(self.generation.admission_request, self.generation.admitted, usage)
        except Exception:
            log.exception("admission release failed")
        await self.usage_reporter.report(self.generation.admission_request.tenant, usage, self.generation.labels)


async def _next_delta(deltas: AsyncIterator[GenerateDelta]) -> GenerateDelta:
    """The next delta. Raises the client's RequestError; a stream that ends unfinished is engine_error."""
    try:
        return await anext(deltas)
    except StopAsyncIteration:
        log.warning("an engine stream ended before its request finished")
        raise RequestError(ErrorCode.ENGINE_ERROR) from None


async def _send_json(send: Send, status: int, body: dict, headers: dict[str, str]) -> None:
    raw = json.dumps(body, separators=(",", ":")).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    head += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": raw})


async def _send_event(send: Send, payload: dict) -> None:
    data = b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": data, "more_body": True})
