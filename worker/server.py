"""The engine worker: an engine loop (engine.async_llm: a child process, or a thread) behind an internal HTTP service (protocol in wire/protocol.py).

`WorkerService` is the transport-free part (adapter loading and unloading, capability checks; the
engine's deltas pass through as they are); the gateway's in-process client uses it directly, and
`build_worker_app` serves it over HTTP with a shared secret, plus `/metrics` (worker/metrics.py). A failed request raises (in process) or ends its NDJSON stream
with (over HTTP) one wire.errors.RequestError. A client that disconnects from `/generate` aborts its
request in the engine.

NOTE: this module must never import gateway/ or policies/ (workers run without them).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import signal
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import replace
from typing import Any

import anyio
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from engine.async_llm import StreamFront
from engine.request import AdapterRef
from wire.errors import ErrorCode, RequestError
from wire.protocol import (
    TRACEPARENT_HEADER,
    WORKER_SECRET_HEADER,
    AdapterSpec,
    GenerateDelta,
    GenerateRequest,
    ProtocolError,
    WorkerState,
    encode_message,
)
from worker.capabilities import WorkerCapabilities
from worker.metrics import worker_metrics_registry
from worker.tracing import WorkerTracing

log = logging.getLogger(__name__)


class WorkerService:
    """Runs protocol requests on one AsyncLLM. Safe to share by all requests of one event loop.

    `capabilities` says what `llm` serves (WorkerCapabilities.of_engine(config) for an LLMEngine); requests
    for anything else are refused by name."""

    def __init__(self, llm: StreamFront, model_name: str, capabilities: WorkerCapabilities,
                 tracer_provider: TracerProvider | None = None) -> None:
        self.llm = llm
        self.model_name = model_name
        self.capabilities = capabilities
        self.tracing = WorkerTracing(tracer_provider)  # spans only when a provider is given
        self._adapters: dict[str, AdapterRef] = {}  # sha256 -> loaded ref
        self._adapter_locks: dict[str, asyncio.Lock] = {}

    @property
    def supports_adapters(self) -> bool:
        return self.capabilities.adapters

    @property
    def supports_structured_output(self) -> bool:
        return self.capabilities.structured_output

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Stream the engine's deltas until one is finished. Raises RequestError (a stable code) when
        the request is refused or fails; any other fault is logged here and raised as engine_error.
        Closing the iterator early aborts the request in the engine. Traced (worker/tracing.py) when
        the service has a provider."""
        spans = self.tracing.request(request, self.model_name)
        deltas = self._run(request)
        error: str | None = None
        try:
            async for delta in deltas:
                if spans is not None:
                    spans.on_delta(delta, self.llm.stats().num_running)
                yield delta
        except RequestError as e:
            error = e.code.value
            raise
        except Exception:  # an engine fault reported as an error, never a dropped stream
            log.exception("request %s failed", request.request_id)
            error = ErrorCode.ENGINE_ERROR.value
            raise RequestError(ErrorCode.ENGINE_ERROR, request_id=request.request_id) from None
        finally:
            await deltas.aclose()
            if spans is not None:
                spans.finish(error)

    async def _run(self, request: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        params = request.sampling
        if params.has_grammar and not self.supports_structured_output:
            raise RequestError(ErrorCode.INVALID_REQUEST, "structured output (response_format) is not "
                               "supported by this engine build", param="response_format")
        adapter = await self._adapter_ref(request.adapter) if request.adapter else None
        async for delta in self.llm.generate(request.request_id, {"prompt_token_ids": request.prompt_token_ids},
                                             params, priority=request.priority, adapter=adapter,
                                             cache_salt=request.cache_salt):
            yield delta

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    def state(self) -> WorkerState:
        """The engine loop's latest snapshot (never touches the engine itself). Adapters are named by
        their sha256, the engine's name for them."""
        s = self.llm.stats()
        return WorkerState(
            num_running=s.num_running, num_waiting=s.num_waiting, num_kv_blocks=s.num_kv_blocks,
            num_free_kv_blocks=s.num_free_kv_blocks, kv_usage=s.kv_usage,
            prefix_query_tokens=s.prefix_query_tokens, prefix_hit_tokens=s.prefix_hit_tokens,
            prefix_cache_blocks=s.prefix_cache_blocks, resident_adapters=sorted(self._adapters),
            model=self.model_name, adapter_loads=s.lora_slot_loads, adapter_evictions=s.lora_slot_evictions,
            weight_bytes=s.weight_bytes, block_size=s.block_size, kv_cache_dtype=s.kv_cache_dtype,
            kv_cache_bytes=s.kv_cache_bytes, max_loras=self.capabilities.max_loras,
            running_adapters=list(s.lora_running_adapters), waiting_adapters=list(s.lora_waiting_adapters),
            adapter_residency=list(s.lora_residency), num_preemptions=s.num_preemptions, prefix_waits=s.prefix_waits,
            adapter_host_loads=s.lora_host_loads, adapter_host_evictions=s.lora_host_evictions,
            faulted_steps=s.faulted_steps, isolated_failures=s.isolated_failures,
            structured_checked=s.structured_checked, structured_guard_failures=s.structured_guard_failures,
            grammar_ignored_formats=dict(s.grammar_ignored_formats), grammar_broken_evicted=s.grammar_broken_evicted,
        )

    async def unload_adapter(self, sha256: str) -> bool:
        """Forget the adapter with this content (its tenant deleted it): a later request naming it loads it
        again from its files; requests running on it finish, then its device slot and host memory are
        freed. False when it was not loaded here."""
        if not self.supports_adapters:
            return False
        lock = self._adapter_locks.setdefault(sha256, asyncio.Lock())
        async with lock:  # NOTE: not while a load of the same content is in progress
            if self._adapters.pop(sha256, None) is None:
                return False
            await self.llm.unload_adapter(sha256)
        return True

    async def _adapter_ref(self, spec: AdapterSpec) -> AdapterRef:
        """Load the adapter once per content hash (the engine's name for it is its sha256). Raises
        RequestError(adapter_unavailable) naming the adapter; the cause (paths included) is only logged."""
        if spec.sha256 in self._adapters:
            return self._adapters[spec.sha256]
        if not self.supports_adapters:
            raise RequestError(ErrorCode.ADAPTER_UNAVAILABLE, f"adapter {spec.name!r} cannot be served: this "
                               "engine build does not support LoRA adapters", param="model")
        lock = self._adapter_locks.setdefault(spec.sha256, asyncio.Lock())
        async with lock:
            if spec.sha256 not in self._adapters:
                try:
                    ref = await self.llm.load_adapter(spec.sha256, spec.path, sha256=spec.sha256)
                except Exception as e:
                    log.warning("adapter %s (%s) could not be loaded: %.300s", spec.name, spec.sha256[:12], e)
                    raise RequestError(ErrorCode.ADAPTER_UNAVAILABLE, f"adapter {spec.name!r} could not be "
                                       "loaded", param="model") from None
                self._adapters[spec.sha256] = ref
        return self._adapters[spec.sha256]


class NdjsonStream(Response):
    """Streams deltas as NDJSON, and the RequestError that ends a failed request as its last line; a
    client disconnect (noticed even while no token is ready) closes the delta iterator, which aborts the
    request in the engine."""

    media_type = "application/x-ndjson"

    def __init__(self, messages: AsyncIterator[GenerateDelta]) -> None:
        # NOTE: no Response.__init__: it would declare content-length 0 for a body that streams.
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", self.media_type.encode())]
        self.messages = messages

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            try:
                async for message in self.messages:
                    await send({"type": "http.response.body", "body": encode_message(message), "more_body": True})
            except RequestError as e:
                await send({"type": "http.response.body", "body": encode_message(e), "more_body": True})
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
                     background: Callable[[WorkerService], Coroutine[Any, Any, None]] | None = None, *,
                     public_metrics: bool = False) -> Starlette:
    """The worker's HTTP app. Every route needs the shared secret in `WORKER_SECRET_HEADER`; `/metrics`
    also takes it as a bearer token (how Prometheus sends credentials), or none with `public_metrics`
    (for an endpoint picker that scrapes without credentials: keep the port on a private network).
    `background(service)` (e.g. a registration heartbeat) runs while the app serves, cancelled at shutdown."""
    if not secret:
        raise ValueError("a worker needs a non-empty shared secret")
    metrics_registry = worker_metrics_registry(service.state)

    def authorized(request: Request) -> bool:
        presented = request.headers.get(WORKER_SECRET_HEADER, "")
        return hmac.compare_digest(presented.encode(), secret.encode())

    def bearer_authorized(request: Request) -> bool:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), secret.encode())

    def refuse() -> JSONResponse:
        return JSONResponse({"error": "missing or wrong worker secret"}, status_code=401)

    async def generate(request: Request) -> Response:
        if not authorized(request):
            return refuse()
        try:
            body = json.loads(await request.body())
            gen = GenerateRequest.from_json(body)
        except (ValueError, TypeError) as e:  # ProtocolError is a ValueError
            message = str(e) if isinstance(e, ProtocolError) else "malformed generate request: not JSON"
            error = RequestError(ErrorCode.INVALID_REQUEST, message)  # one error line, as in a stream
            return Response(encode_message(error), status_code=400, media_type=NdjsonStream.media_type)
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

    async def unload_adapter(request: Request) -> Response:
        if not authorized(request):
            return refuse()
        try:
            sha = (await request.json())["sha256"]
            if not isinstance(sha, str) or not sha:
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return JSONResponse({"error": "body must be {\"sha256\": str}"}, status_code=400)
        return JSONResponse({"unloaded": await service.unload_adapter(sha)})

    async def metrics(request: Request) -> Response:
        if not (public_metrics or authorized(request) or bearer_authorized(request)):
            return refuse()
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

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
        Route("/adapters/unload", unload_adapter, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], lifespan=lifespan)


FATAL_EXIT_GRACE_S = 10.0  # after an unattributable engine fault: time for in-flight error lines to go out
FATAL_EXIT_CODE = 70


def exit_on_engine_fault(error: BaseException) -> None:
    """AsyncLLM's on_fatal for a worker process: every request in flight has been failed; stop serving
    so that the process exits and its supervisor (or Kubernetes) starts a fresh one. uvicorn shuts down
    as on SIGTERM (the error lines in flight go out) and then ends the process with that signal; a
    shutdown that hangs ends it with FATAL_EXIT_CODE."""
    log.critical("engine fault not attributable to a request (%.300s); the worker exits", error)
    os.kill(os.getpid(), signal.SIGTERM)
    # A backstop: should a connection keep the graceful shutdown waiting, leave anyway.
    backstop = threading.Timer(FATAL_EXIT_GRACE_S, os._exit, args=(FATAL_EXIT_CODE,))
    backstop.daemon = True
    backstop.start()


def run_worker(llm: StreamFront, model_name: str, secret: str, capabilities: WorkerCapabilities,
               host: str = "127.0.0.1", port: int = 8001, tracer_provider: SdkTracerProvider | None = None,
               background: Callable[[WorkerService], Coroutine[Any, Any, None]] | None = None,
               public_metrics: bool = False) -> None:
    """Serve until interrupted (blocking). Loopback by default: the secret is not a substitute for a
    private network. `tracer_provider` (its spans exported by the caller's setup) is shut down at exit.
    `capabilities` as in `WorkerService`, `background` and `public_metrics` as in `build_worker_app`."""
    import uvicorn

    app = build_worker_app(WorkerService(llm, model_name, capabilities, tracer_provider), secret, background,
                           public_metrics=public_metrics)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    finally:
        llm.shutdown()
        if tracer_provider is not None:
            tracer_provider.shutdown()  # flushes its exporters


__all__ = ["NdjsonStream", "WorkerCapabilities", "WorkerService", "build_worker_app", "run_worker"]
