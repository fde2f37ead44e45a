"""Streaming entry point for servers: the engine loop in its own thread, asyncio streams per request.

The loop thread alone touches the LLMEngine. Callers post commands (add, abort) to an inbox; the loop
drains it between steps, runs `step()`, and hands each request's delta (wire.protocol.GenerateDelta:
only what is new) to the caller's event loop. A request that fails ends its stream with a
wire.errors.RequestError carrying a stable code. The engine fails only the requests a step's fault is
attributed to (engine/fault_isolation.py); a fault that escapes `step()` fails every request in flight
(releasing everything they hold; the fault is logged here, tenants get only the code's message), and then
`on_fatal` stops the loop (a worker exits and is restarted) or, without it, the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import EngineStats, LLMEngine, PromptType, StepOutput
from engine.request import AdapterRef, RequestStatus
from wire.errors import ErrorCode, RequestError
from wire.protocol import GenerateDelta
from wire.sampling import InvalidSamplingParams, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # GenerateDelta | RequestError


class AsyncLLM:
    def __init__(self, engine: LLMEngine, on_fatal: Callable[[BaseException], None] | None = None) -> None:
        """`on_fatal(error)` is called (on the loop thread, once) after a step raised a fault no request
        could be blamed for (engine.fault_isolation.EngineFault) and every request in flight was failed;
        the loop then stops serving (a worker exits, so that its supervisor restarts it). None: the loop
        serves on (embedded use, tests)."""
        self.engine = engine
        self.on_fatal = on_fatal
        self.fatal_error: BaseException | None = None
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._stats = engine.stats()
        self.step_count = 0
        self._idle_checked = True
        self.integrity_failures = 0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, on_fatal: Callable[[BaseException], None] | None = None) -> AsyncLLM:
        return cls(LLMEngine(config), on_fatal)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    # ----- public API -------------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                       priority: int = 0, adapter: AdapterRef | None = None,
                       cache_salt: str = "") -> AsyncIterator[GenerateDelta]:
        """Stream the request's deltas until one is finished. Raises RequestError when it fails:
        invalid_request for one that can never run (the engine's reason as message), another code when
        it fails while running. Leaving the iteration early (client disconnect, cancellation) aborts
        the request in the engine.
        """
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if self.fatal_error is not None:  # the loop stopped for an engine fault; the worker restarts
                raise RequestError(ErrorCode.WORKER_UNAVAILABLE, request_id=request_id)
            if request_id in self._streams:
                raise RequestError(ErrorCode.INVALID_REQUEST, f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt, params, priority=priority, adapter=adapter,
                                        cache_salt=cache_salt)
            except ValueError as e:  # refused: the engine's reason names what is wrong with the request
                param = e.param if isinstance(e, InvalidSamplingParams) else None
                self._deliver(request_id, RequestError(ErrorCode.INVALID_REQUEST, str(e), param=param,
                                                       request_id=request_id))
            except Exception:  # a fault of the engine, not of the request: keep serving
                log.exception("adding request %s failed", request_id)
                self._deliver(request_id, RequestError(ErrorCode.ENGINE_ERROR, request_id=request_id))

        self._post(add)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, RequestError):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._post(lambda: self._abort_now(request_id))

    async def abort(self, request_id: str) -> None:
        self._post(lambda: self._abort_now(request_id))

    def stats(self) -> EngineStats:
        """Snapshot taken by the loop after its latest step (cheap, thread-safe)."""
        return self._stats

    def call_in_loop(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future:
        """Run fn(engine) on the loop thread between steps; await the returned future for its result.
        `stats()` reflects what fn changed (a loaded or unloaded adapter) once the future is done."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except Exception as e:
                loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                self._stats = self.engine.stats()
                loop.call_soon_threadsafe(_set_result, fut, result)

        self._post(run)
        return fut

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():  # NOTE: the loop thread owns the engine until it has ended
            self.engine.shutdown()

    # ----- loop thread ------------------------------------------------------------------------------

    def _post(self, cmd: Callable[[], None]) -> None:
        self._inbox.put(cmd)
        self._wake.set()

    def _abort_now(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)
        if out is not None:
            self._deliver(request_id, out)

    def _deliver(self, request_id: str, item: StepOutput) -> None:
        final = isinstance(item, RequestError) or item.finished
        with self._lock:
            stream = self._streams.pop(request_id, None) if final else self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _run(self) -> None:
        while not self._stopping:
            while True:
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    break
                cmd()
            if not self.engine.has_unfinished_requests():
                self._stats = self.engine.stats()
                if not self._idle_checked:
                    self._check_idle_integrity()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a fault no request is to blame for: fail what was in flight
                log.exception("engine step failed")
                if self.on_fatal is not None:
                    with self._lock:  # NOTE: set before _fail_all, so a stream opened later is refused
                        self.fatal_error = e
                    self._stopping = True
                self._fail_all()
                if self.on_fatal is not None:
                    self.on_fatal(e)
                continue
            self.step_count += 1
            self._idle_checked = False
            self._stats = self.engine.stats()  # before delivering: a caller that saw a token sees this step
            if not outputs and not self.engine.scheduler.running:
                # Everything waits on something off the loop (a grammar compile, an adapter read): nap
                # briefly instead of spinning; a new command wakes the loop at once.
                self._wake.wait(timeout=0.002)
                self._wake.clear()
            for out in outputs:
                self._deliver(out.request_id, out)

    def _check_idle_integrity(self) -> None:
        """Once per idle spell: prove every KV block, slot pin and grammar hold is accounted for."""
        self._idle_checked = True
        try:
            self.engine.scheduler.check_integrity()
        except AssertionError:
            self.integrity_failures += 1
            log.exception("engine integrity check failed while idle")

    def _fail_all(self) -> None:
        with self._lock:
            ids = list(self._streams)
        error = RequestError(ErrorCode.ENGINE_ERROR)
        for rid in ids:
            self.engine.fail_request(rid, error)
            self._deliver(rid, error.for_request(rid))
        for rid in list(self.engine.scheduler.requests):  # anything not streamed through generate()
            self.engine.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
