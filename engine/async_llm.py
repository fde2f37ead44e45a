"""Streaming entry point for servers: the engine loop off the event loop, asyncio streams per request.

One `EngineLoop` alone touches the LLMEngine. Callers post commands (add, abort, a call) to it; the loop
runs them between steps, runs `step()`, and emits each request's delta (wire.protocol.GenerateDelta: only
what is new) or the wire.errors.RequestError that ends it (a stable code). `AsyncLLM` runs the loop on a
thread of this process; engine.core_process.ProcessAsyncLLM runs it as the main loop of a child process
(a worker's default: no other thread of the engine's process competes with the step for the GIL). Both
share `StreamFront`, the side callers see: a stream per request, `generate()`, `abort()`, `stats()`.

The engine fails only the requests a step's fault is attributed to (engine/fault_isolation.py); a fault
that escapes `step()` fails every request in flight (releasing everything they hold; the fault is logged
where the engine runs, tenants get only the code's message), and then `on_fatal` stops serving (a worker
exits and is restarted) or, without it, the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.request import AdapterRef
from wire.errors import ErrorCode, RequestError
from wire.protocol import GenerateDelta
from wire.sampling import InvalidSamplingParams, SamplingParams

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm_engine import EngineStats, LLMEngine, PromptType, StepOutput

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long an idle loop sleeps before it looks again (a command wakes it at once)
BLOCKED_NAP_S = 0.002  # a nap while every request waits on work off the loop (a grammar compile, an adapter read)


# ----- commands: what callers post to the loop (picklable: they also cross to a child process) ----------


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    priority: int = 0
    adapter: AdapterRef | None = None
    cache_salt: str = ""

    def __call__(self, engine: LLMEngine) -> list[StepOutput]:
        try:
            engine.add_request(self.request_id, self.prompt, self.params, priority=self.priority,
                               adapter=self.adapter, cache_salt=self.cache_salt)
        except ValueError as e:  # refused: the engine's reason names what is wrong with the request
            param = e.param if isinstance(e, InvalidSamplingParams) else None
            return [RequestError(ErrorCode.INVALID_REQUEST, str(e), param=param, request_id=self.request_id)]
        except Exception:  # a fault of the engine, not of the request: keep serving
            log.exception("adding request %s failed", self.request_id)
            return [RequestError(ErrorCode.ENGINE_ERROR, request_id=self.request_id)]
        return []


@dataclass(frozen=True)
class AbortRequest:
    request_id: str

    def __call__(self, engine: LLMEngine) -> list[StepOutput]:
        out = engine.abort_request(self.request_id)
        return [out] if out is not None else []


@dataclass(frozen=True)
class LoadAdapter:
    """A call (`call_in_loop`): LLMEngine.load_adapter, returning its AdapterRef."""

    name: str
    path: str
    sha256: str | None = None

    def __call__(self, engine: LLMEngine) -> AdapterRef:
        return engine.load_adapter(self.name, self.path, sha256=self.sha256)


@dataclass(frozen=True)
class UnloadAdapter:
    name: str

    def __call__(self, engine: LLMEngine) -> AdapterRef:
        return engine.unload_adapter(self.name)


Command = Callable[["LLMEngine"], "list[StepOutput]"]


# ----- the engine side --------------------------------------------------------------------------------


class EngineLoop:
    """Runs the commands posted since the last step, steps, emits the outputs; the only code that touches
    its LLMEngine while it runs.

    `emit(outputs)` gets each step's outputs (and those of commands) in order. On a fault no request can
    be blamed for, every request in flight is failed and emitted, then `on_fault(error)` is called;
    with `stop_on_fault` the loop then ends."""

    def __init__(self, engine: LLMEngine, emit: Callable[[list[StepOutput]], None],
                 on_fault: Callable[[BaseException], None], *, stop_on_fault: bool) -> None:
        self.engine = engine
        self.emit = emit
        self.on_fault = on_fault
        self.stop_on_fault = stop_on_fault
        self.stopping = False
        self.stats = engine.stats()  # the snapshot after the latest step (callers read it, never the engine)
        self.integrity_failures = 0
        self.idle_checked = True

    def run(self, take_commands: Callable[[float], list[Command]],
            on_idle: Callable[[], None] | None = None) -> None:
        """Serve until `stopping`. `take_commands(timeout)` returns the commands posted so far, waiting up
        to `timeout` s for one when there are none (0: never wait). `on_idle()` is called each time the
        loop finds nothing to run, after its stats were refreshed."""
        while not self.stopping:
            self._run(take_commands(0.0))
            if not self.engine.has_unfinished_requests():
                self.stats = self.engine.stats()
                if not self.idle_checked:
                    self._check_idle_integrity()
                if on_idle is not None:
                    on_idle()
                self._run(take_commands(IDLE_WAIT_S))
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a fault no request is to blame for: fail what was in flight
                self._fault(e)
                continue
            self.idle_checked = False
            self.stats = self.engine.stats()  # before emitting: a caller that saw a token sees this step
            if outputs:
                self.emit(outputs)
            if not outputs and not self.engine.scheduler.running:
                # Everything waits on something off the loop: nap briefly instead of spinning.
                self._run(take_commands(BLOCKED_NAP_S))

    def _run(self, commands: list[Command]) -> None:
        outputs: list[StepOutput] = []
        for cmd in commands:
            outputs += cmd(self.engine)
        if outputs:
            self.emit(outputs)

    def _fault(self, error: Exception) -> None:
        log.exception("engine step failed")
        if self.stop_on_fault:
            self.stopping = True
        self.emit(self.engine.fail_all(RequestError(ErrorCode.ENGINE_ERROR)))
        self.on_fault(error)

    def _check_idle_integrity(self) -> None:
        """Once per idle spell: prove every KV block, slot pin and grammar hold is accounted for."""
        self.idle_checked = True
        try:
            self.engine.scheduler.check_integrity()
        except AssertionError:
            self.integrity_failures += 1
            log.exception("engine integrity check failed while idle")


# ----- the callers' side -------------------------------------------------------------------------------


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # GenerateDelta | RequestError


class StreamFront:
    """The side of an engine loop that callers see: a stream per request. Subclasses post commands to
    their loop (`_post`) and hand what it emits to `_deliver`."""

    def __init__(self, on_fatal: Callable[[BaseException], None] | None) -> None:
        """`on_fatal(error)` is called (once) after a fault no request could be blamed for
        (engine.fault_isolation.EngineFault) and every request in flight was failed; the loop then stops
        serving (a worker exits, so that its supervisor restarts it). None: the loop serves on (embedded
        use, tests)."""
        self.on_fatal = on_fatal
        self.fatal_error: BaseException | None = None
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()

    def _post(self, cmd: Command) -> None:
        raise NotImplementedError

    def stats(self) -> EngineStats:
        raise NotImplementedError

    def call_in_loop(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future:
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

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
        self._post(AddRequest(request_id, prompt, params, priority, adapter, cache_salt))
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
                self._post(AbortRequest(request_id))

    async def abort(self, request_id: str) -> None:
        self._post(AbortRequest(request_id))

    async def load_adapter(self, name: str, path: str, *, sha256: str | None = None) -> AdapterRef:
        """LLMEngine.load_adapter on the loop (its errors raised here)."""
        return await self.call_in_loop(LoadAdapter(name, str(path), sha256))

    async def unload_adapter(self, name: str) -> AdapterRef:
        return await self.call_in_loop(UnloadAdapter(name))

    # ----- delivery (from whichever thread hands over the loop's outputs) ------------------------------

    def _deliver(self, outputs: list[StepOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StepOutput]]] = {}
        with self._lock:
            for item in outputs:
                final = isinstance(item, RequestError) or item.finished
                stream = self._streams.pop(item.request_id, None) if final else self._streams.get(item.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in by_loop.items():  # one wake-up per event loop, not one per delta
            loop.call_soon_threadsafe(_put_all, items)

    def _engine_fault(self, error: BaseException, *, stopped: bool) -> None:
        """The loop failed every request it held for `error`. `stopped`: it serves no more, so the
        streams whose requests it never took are failed too, new ones are refused, and on_fatal runs."""
        if not stopped:
            return
        with self._lock:  # NOTE: set before the sweep, so a stream opened later is refused
            self.fatal_error = error
            left, self._streams = self._streams, {}
        failure = RequestError(ErrorCode.ENGINE_ERROR)
        for rid, stream in left.items():
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, failure.for_request(rid))
        if self.on_fatal is not None:
            self.on_fatal(error)


class AsyncLLM(StreamFront):
    """The engine loop on a thread of this process (embedded use, tests: `engine` is there to inspect)."""

    def __init__(self, engine: LLMEngine, on_fatal: Callable[[BaseException], None] | None = None) -> None:
        super().__init__(on_fatal)
        self.engine = engine
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self.loop = EngineLoop(engine, self._deliver, self._on_fault, stop_on_fault=on_fatal is not None)
        self._thread = threading.Thread(target=self.loop.run, args=(self._take,), name="engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, on_fatal: Callable[[BaseException], None] | None = None) -> AsyncLLM:
        from engine.llm_engine import LLMEngine

        return cls(LLMEngine(config), on_fatal)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def integrity_failures(self) -> int:
        return self.loop.integrity_failures

    def stats(self) -> EngineStats:
        """Snapshot taken by the loop after its latest step (cheap, thread-safe)."""
        return self.loop.stats

    def call_in_loop(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future:
        """Run fn(engine) on the loop thread between steps; await the returned future for its result.
        `stats()` reflects what fn changed (a loaded or unloaded adapter) once the future is done."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def run(engine: LLMEngine) -> list[StepOutput]:
            try:
                result = fn(engine)
            except Exception as e:
                loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                self.loop.stats = engine.stats()
                loop.call_soon_threadsafe(_set_result, fut, result)
            return []

        self._post(run)
        return fut

    def shutdown(self, timeout: float = 10.0) -> None:
        self.loop.stopping = True
        self._wake.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():  # NOTE: the loop thread owns the engine until it has ended
            self.engine.shutdown()

    def _post(self, cmd: Command) -> None:
        self._inbox.put(cmd)
        self._wake.set()

    def _take(self, timeout: float) -> list[Command]:
        if timeout > 0 and self._inbox.empty():
            self._wake.wait(timeout)
        self._wake.clear()
        commands = []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _on_fault(self, error: BaseException) -> None:
        self._engine_fault(error, stopped=self.loop.stop_on_fault)


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
