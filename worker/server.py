"""The engine worker: an AsyncLLM behind an internal HTTP service (protocol in wire/protocol.py).

`WorkerService` is the transport-free part (adapter loading, sampling params, outputs to protocol
messages); the gateway's in-process client uses it directly, and `build_worker_app` serves it over
HTTP with a shared secret. A client that disconnects from `/generate` aborts its request in the engine.

NOTE: this module must never import gateway/ or policies/ (workers run without them).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import replace
from typing import Any

import anyio
from opentelemetry.trace import TracerProvider
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from engine.async_llm import AsyncLLM
from engine.outputs import Logprob, RequestOutput
from engine.request import AdapterRef
from wire.protocol import (
    ADAPTER_UNAVAILABLE,
    ENGINE_ERROR,
    INVALID_REQUEST,
    TRACEPARENT_HEADER,
    WORKER_SECRET_HEADER,
    AdapterSpec,
    GenerateDelta,
    GenerateError,
    GenerateRequest,
    ProtocolError,
    SampleDelta,
    TokenLogprob,
    WorkerState,
    encode_message,
)
from wire.sampling import SamplingParams
from worker.tracing import WorkerTracing

log = logging.getLogger(__name__)


class AdapterUnavailable(Exception):
    pass


class WorkerService:
    """Runs protocol requests on one AsyncLLM. Safe to share by all requests of one event loop."""

    def __init__(self, llm: AsyncLLM, model_name: str, tracer_provider: TracerProvider | None = None) -> None:
        self.llm = llm
        self.model_name = model_name
        self.tracing = WorkerTracing(tracer_provider)  # spans only when a provider is given
        self._adapters: dict[str, AdapterRef] = {}  # sha256 -> loaded ref
        self._adapter_locks: dict[str, asyncio.Lock] = {}

    @property
    def supports_adapters(self) -> bool:
        return callable(getattr(self.llm.engine, "load_adapter", None))

    @property
    def supports_structured_output(self) -> bool:
        engine = self.llm.engine
        declared = getattr(engine, "supports_structured_output", None)
        if declared is not None:
            return bool(declared)
        return getattr(getattr(engine, "runner", None), "grammar_masker", None) is not None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta | GenerateError]:
        """Stream deltas until one is finished, or yield one GenerateError. Closing the iterator early
        aborts the request in the engine. Traced (worker/tracing.py) when the service has a provider."""
        spans = self.tracing.request(request, self.model_name)
        messages = self._run(request)
        error: str | None = None
        try:
            async for message in messages:
                if spans is not None:
                    if isinstance(message, GenerateError):
                        error = message.message
                    else:
                        spans.on_delta(message, self.llm.stats().num_running)
                yield message
        finally:
            await messages.aclose()
            if spans is not None:
                spans.finish(error)

    async def _run(self, request: GenerateRequest) -> AsyncGenerator[GenerateDelta | GenerateError, None]:
        rid = request.request_id
        try:
            params = SamplingParams(**request.sampling)
        except (TypeError, ValueError) as e:
            yield GenerateError(rid, INVALID_REQUEST, f"invalid sampling parameters: {e}")
            return
        if params.has_grammar and not self.supports_structured_output:
            yield GenerateError(rid, INVALID_REQUEST,
                                "structured output (response_format) is not supported by this engine build")
            return
        try:
            adapter = await self._adapter_ref(request.adapter) if request.adapter else None
        except AdapterUnavailable as e:
            yield GenerateError(rid, ADAPTER_UNAVAILABLE, str(e))
            return
        with_logprobs = params.logprobs is not None
        started = False
        try:
            async for out in self.llm.generate(rid, {"prompt_token_ids": request.prompt_token_ids}, params,
                                               priority=request.priority, adapter=adapter,
                                               cache_salt=request.cache_salt):
                started = True
                yield delta_from_output(out, with_logprobs)
        except ValueError as e:
            code = INVALID_REQUEST if not started else ENGINE_ERROR
            yield GenerateError(rid, code, str(e))
        except Exception as e:  # an engine fault reported as a message, never a dropped stream
            log.exception("request %s failed", rid)
            yield GenerateError(rid, ENGINE_ERROR, f"engine error: {type(e).__name__}: {e}")

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    def state(self) -> WorkerState:
        s = self.llm.stats()
        return WorkerState(
            num_running=s.num_running, num_waiting=s.num_waiting, num_kv_blocks=s.num_kv_blocks,
            num_free_kv_blocks=s.num_free_kv_blocks, kv_usage=s.kv_usage,
            prefix_query_tokens=s.prefix_query_tokens, prefix_hit_tokens=s.prefix_hit_tokens,
            prefix_cache_blocks=s.prefix_cache_blocks, resident_adapters=sorted(self._adapters),
            model=self.model_name, adapter_loads=s.lora_slot_loads, adapter_evictions=s.lora_slot_evictions,
        )

    async def _adapter_ref(self, spec: AdapterSpec) -> AdapterRef:
        """Load the adapter once per content hash (the engine's name for it is its sha256)."""
        if spec.sha256 in self._adapters:
            return self._adapters[spec.sha256]
        if not self.supports_adapters:
            raise AdapterUnavailable(
                f"adapter {spec.name!r} cannot be served: this engine build does not support LoRA adapters"
            )
        lock = self._adapter_locks.setdefault(spec.sha256, asyncio.Lock())
        async with lock:
            if spec.sha256 not in self._adapters:
                try:
                    ref = await self.llm.call_in_loop(
                        lambda engine: engine.load_adapter(spec.sha256, spec.path, sha256=spec.sha256)
                    )
                except Exception as e:
                    raise AdapterUnavailable(f"adapter {spec.name!r} could not be loaded: {e}") from None
                self._adapters[spec.sha256] = ref
        return self._adapters[spec.sha256]


class NdjsonStream(Response):
    """Streams protocol messages as NDJSON; a client disconnect (noticed even while no token is
    ready) closes the message iterator, which aborts the request in the engine."""

    media_type = "application/x-ndjson"

    def __init__(self, messages: AsyncIterator[GenerateDelta | GenerateError]) -> None:
        # NOTE: no Response.__init__: it would declare content-length 0 for a body that streams.
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", self.media_type.encode())]
        self.messages = messages

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for message in self.messages:
                await send({"type": "http.response.body", "body": encode_message(message), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        try:
            async with anyio.create_task_group() as tg:
                async def run(fn: Any) -> None:
                    with contextlib.suppress(OSError):
                        await fn()
                    tg.cancel_scope.cancel()

                tg.start_soon(run, pump)
                tg.start_soon(run, watch)
        finally:
            with anyio.CancelScope(shield=True):
                await self.messages.aclose()  # type: ignore[attr-defined]


def build_worker_app(service: WorkerService, secret: str,
                     background: Callable[[WorkerService], Coroutine[Any, Any, None]] | None = None) -> Starlette:
    """The worker's HTTP app. Every route needs the shared secret in `WORKER_SECRET_HEADER`.
    `background(service)` (e.g. a registration heartbeat) runs while the app serves, cancelled at shutdown."""
    if not secret:
        raise ValueError("a worker needs a non-empty shared secret")

    def authorized(request: Request) -> bool:
        presented = request.headers.get(WORKER_SECRET_HEADER, "")
        return hmac.compare_digest(presented.encode(), secret.encode())

    def refuse() -> JSONResponse:
        return JSONResponse({"error": "missing or wrong worker secret"}, status_code=401)

    async def generate(request: Request) -> Response:
        if not authorized(request):
            return refuse()
        try:
            body = json.loads(await request.body())
            gen = GenerateRequest.from_json(body)
        except (ValueError, TypeError) as e:  # ProtocolError is a ValueError
            message = str(e) if isinstance(e, ProtocolError) else f"malformed generate request: {e}"
            return JSONResponse({"error": message}, status_code=400)
        if request.headers.get(TRACEPARENT_HEADER) and not gen.traceparent:
            gen = replace(gen, traceparent=request.headers[TRACEPARENT_HEADER])
        return NdjsonStream(service.generate(gen))

    async def abort(request: Request) -> Response:
        if not authorized(request):
            return refuse()
        try:
            rid = (await request.json())["request_id"]
            if not isinstance(rid, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return JSONResponse({"error": "body must be {\"request_id\": str}"}, status_code=400)
        await service.abort(rid)
        return JSONResponse({"aborted": True})

    async def state(request: Request) -> Response:
        if not authorized(request):
            return refuse()
        return JSONResponse(service.state().to_json())

    async def health(request: Request) -> Response:
        if not authorized(request):
            return refuse()
        return JSONResponse({"status": "ok", "model": service.model_name})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(background(service)) if background else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    return Starlette(routes=[
        Route("/generate", generate, methods=["POST"]),
        Route("/abort", abort, methods=["POST"]),
        Route("/state", state, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ], lifespan=lifespan)


def run_worker(llm: AsyncLLM, model_name: str, secret: str, host: str = "127.0.0.1", port: int = 8001,
               tracer_provider: TracerProvider | None = None,
               background: Callable[[WorkerService], Coroutine[Any, Any, None]] | None = None) -> None:
    """Serve until interrupted (blocking). Loopback by default: the secret is not a substitute for a
    private network. `tracer_provider` (its spans exported by the caller's setup) is shut down at exit.
    `background` as in `build_worker_app`."""
    import uvicorn

    app = build_worker_app(WorkerService(llm, model_name, tracer_provider), secret, background)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    finally:
        llm.shutdown()
        shutdown = getattr(tracer_provider, "shutdown", None)  # the SDK provider flushes its exporters
        if callable(shutdown):
            shutdown()


__all__ = ["AdapterUnavailable", "NdjsonStream", "WorkerService", "build_worker_app", "run_worker"]


def delta_from_output(out: RequestOutput, with_logprobs: bool) -> GenerateDelta:
    """The wire form of one RequestOutput: only what changed since the previous one."""
    samples = [
        SampleDelta(
            index=c.index, text=c.delta_text, token_ids=list(c.delta_token_ids),
            logprobs=[_token_logprob(lp) for lp in c.delta_logprobs] if with_logprobs else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
        )
        for c in out.outputs
    ]
    return GenerateDelta(out.request_id, samples, len(out.prompt_token_ids), out.num_cached_tokens,
                         out.finished, out.error)


def _token_logprob(lp: Logprob) -> TokenLogprob:
    return TokenLogprob(lp.token_id, float(lp.logprob), [(int(t), float(v)) for t, v in lp.top])
