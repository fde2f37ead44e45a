"""The engine loop in a child process of its own (a worker's default), with the same front as AsyncLLM.

Why a process: with the loop on a thread, the step's Python (scheduling, batch building, sampling,
detokenizing) shares one GIL with the HTTP side (parsing, encoding a line per delta, the client
connections), and every hand-over between them waits on the other; on a small CPU the step stretches
well past its own compute. vLLM v1 splits its EngineCore off the API server for the same reason. Here the
child does nothing but run the EngineLoop; the parent keeps the streams.

Two one-way pipes (multiprocessing connections, pickled messages):

    parent -> child   a Command (AddRequest, AbortRequest), _Call(call_id, fn) or None (stop)
    child -> parent   ("ready", model_config, stats) | ("failed", exception)          once, at start
                      ("out", outputs, stats)        after each step or batch of commands with outputs
                      ("idle", stats, integrity_failures)   each time the loop finds nothing to run
                      ("result", call_id, ok, value, stats) for a _Call (value: its result or exception)
                      ("fault", message)             every request in flight was failed (EngineLoop)

The parent sends from a thread of its own (a command never blocks the event loop on a full pipe) and
reads on another (each message's outputs go to their streams' event loops). A child that dies (a native
crash, the OOM killer) reads as a fault no request can be blamed for: every stream fails, on_fatal runs.
A child whose parent dies reads end-of-file on its command pipe and exits.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from engine.async_llm import AddRequest, Command, EngineLoop, StreamFront
from engine.fault_isolation import EngineFault
from wire.errors import ErrorCode, RequestError

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm_engine import EngineStats, LLMEngine, StepOutput
    from wire.checkpoint import ModelConfig

log = logging.getLogger(__name__)

START_TIMEOUT_S = 1800.0  # a large checkpoint on a slow disk: loading and packing take minutes


@dataclass(frozen=True)
class _Call:
    call_id: int
    fn: Callable[[LLMEngine], Any]  # picklable: a module-level function, async_llm.LoadAdapter, ...


class ProcessAsyncLLM(StreamFront):
    """AsyncLLM's front over an EngineLoop running in a child process.

    `threads` sets the child's intra-op CPU threads (torch.set_num_threads) before the engine is built.
    Raises what building the engine raised (a bad checkpoint, a config the device cannot serve)."""

    def __init__(self, config: EngineConfig, on_fatal: Callable[[BaseException], None] | None = None, *,
                 threads: int | None = None, start_timeout_s: float = START_TIMEOUT_S) -> None:
        super().__init__(on_fatal)
        ctx = multiprocessing.get_context("spawn")  # NOTE: never fork a process that may hold CUDA or OpenMP
        cmd_read, self._cmd = ctx.Pipe(duplex=False)
        self._out, out_write = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=serve_engine_core, name="loraplex-engine-core", daemon=True,
                                 args=(config, cmd_read, out_write, threads, on_fatal is not None,
                                       logging.getLogger().getEffectiveLevel()))
        self._proc.start()
        cmd_read.close()
        out_write.close()
        self._stopping = False
        try:
            self.model_config, self._stats = self._wait_ready(start_timeout_s)
        except BaseException:
            self._kill()
            raise
        self.integrity_failures = 0
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._next_call = 0
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="engine-core-send", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="engine-core-read", daemon=True)
        self._sender.start()
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def stats(self) -> EngineStats:
        """The child's snapshot after its latest step, as last received (cheap, thread-safe)."""
        return self._stats

    def call_in_loop(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future:
        """Run fn(engine) in the child between steps (fn must pickle); await the future for its result.
        `stats()` reflects what fn changed once the future is done."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._lock:
            if self.fatal_error is not None:
                raise RuntimeError("the engine process has stopped")
            self._next_call += 1
            call_id = self._next_call
            self._calls[call_id] = (loop, fut)
        self._post(_Call(call_id, fn))
        return fut

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._outbox.put(None)
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._kill()
        self._reader.join(timeout)

    # ----- parent threads ----------------------------------------------------------------------------

    def _post(self, cmd: Command | _Call) -> None:
        self._outbox.put(cmd)

    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            try:
                self._cmd.send(msg)
            except (OSError, ValueError):  # the child is gone: the reader reports it
                return
            except Exception:  # a command that does not pickle (nothing was written): fail it, not the loop
                log.exception("a command for the engine process could not be sent")
                self._refuse(msg)
                continue
            if msg is None:
                return

    def _refuse(self, msg: Command | _Call) -> None:
        """The caller of a command that never reached the child gets its failure."""
        if isinstance(msg, _Call):
            with self._lock:
                loop, fut = self._calls.pop(msg.call_id)
            loop.call_soon_threadsafe(_resolve, fut, False, RuntimeError("the call could not be sent to the "
                                                                         "engine process (it does not pickle)"))
        elif isinstance(msg, AddRequest):
            self._deliver([RequestError(ErrorCode.ENGINE_ERROR, request_id=msg.request_id)])

    def _read_loop(self) -> None:
        expected_exit = False
        while True:
            try:
                msg = self._out.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "out":
                self._stats = msg[2]
                self._deliver(msg[1])
            elif kind == "idle":
                self._stats, self.integrity_failures = msg[1], msg[2]
            elif kind == "result":
                _, call_id, ok, value, self._stats = msg
                with self._lock:
                    loop, fut = self._calls.pop(call_id)
                loop.call_soon_threadsafe(_resolve, fut, ok, value)
            elif kind == "fault":
                stopped = self.on_fatal is not None  # the child's loop stopped too (stop_on_fault)
                self._engine_fault(EngineFault(msg[1]), stopped=stopped)
                expected_exit = expected_exit or stopped  # NOTE: its exit that follows is no second fault
        if not (self._stopping or expected_exit):  # the child died under us
            self._proc.join(5.0)
            error = EngineFault(f"the engine process ended unexpectedly (exit code {self._proc.exitcode})")
            log.critical("%s", error)
            self._engine_fault(error, stopped=True)
        with self._lock:
            calls, self._calls = self._calls, {}
        for loop, fut in calls.values():
            loop.call_soon_threadsafe(_resolve, fut, False, RuntimeError("the engine process has stopped"))

    def _wait_ready(self, timeout_s: float) -> tuple[ModelConfig, EngineStats]:
        deadline = time.monotonic() + timeout_s
        while not self._out.poll(0.2):
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine process exited while starting (exit code {self._proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine process did not start within {timeout_s:.0f} s")
        msg = self._out.recv()
        if msg[0] == "failed":
            raise msg[1]
        return msg[1], msg[2]

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5.0)


def _resolve(fut: asyncio.Future, ok: bool, value: Any) -> None:
    if fut.done():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


# ----- the child ---------------------------------------------------------------------------------------


def serve_engine_core(config: EngineConfig, commands: Connection, out: Connection, threads: int | None,
                      stop_on_fault: bool, log_level: int) -> None:
    """The child's main: build the engine, say ready, run the EngineLoop over the pipes until told to
    stop or until the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # NOTE: Ctrl-C reaches the parent, which stops us
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s engine[{os.getpid()}] %(name)s: "
                                                "%(message)s")
    try:
        if threads:
            import torch

            torch.set_num_threads(threads)
        from engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
    except BaseException as e:
        out.send(("failed", _picklable(e)))
        return
    core = _Core(engine, commands, out, stop_on_fault)
    out.send(("ready", engine.model_config, engine.stats()))
    try:
        core.loop.run(core.take, on_idle=core.idle)
    finally:
        engine.shutdown()


class _Core:
    def __init__(self, engine: LLMEngine, commands: Connection, out: Connection, stop_on_fault: bool) -> None:
        self.engine = engine
        self.commands = commands
        self.out = out
        self.loop = EngineLoop(engine, self.emit, self.fault, stop_on_fault=stop_on_fault)

    def emit(self, outputs: list[StepOutput]) -> None:
        self.out.send(("out", outputs, self.loop.stats))

    def fault(self, error: BaseException) -> None:
        self.out.send(("fault", f"{type(error).__name__}: {error}"[:300]))

    def idle(self) -> None:
        self.out.send(("idle", self.loop.stats, self.loop.integrity_failures))

    def take(self, timeout: float) -> list[Command]:
        taken: list[Command] = []
        try:
            if not self.commands.poll(timeout):
                return taken
            while True:
                msg = self.commands.recv()
                if msg is None:
                    self.loop.stopping = True
                    return taken
                taken.append(self._call(msg) if isinstance(msg, _Call) else msg)
                if not self.commands.poll(0):
                    return taken
        except (EOFError, OSError):  # the parent is gone
            self.loop.stopping = True
            return taken

    def _call(self, call: _Call) -> Command:
        def run(engine: LLMEngine) -> list[StepOutput]:
            try:
                value, ok = call.fn(engine), True
            except Exception as e:
                value, ok = _picklable(e), False
            self.loop.stats = engine.stats()
            try:
                self.out.send(("result", call.call_id, ok, value, self.loop.stats))
            except (TypeError, AttributeError, pickle.PicklingError) as e:  # a result that does not pickle
                self.out.send(("result", call.call_id, False, RuntimeError(f"unpicklable result: {e}"),
                               self.loop.stats))
            return []

        return run


def _picklable(error: BaseException) -> BaseException:
    """`error` itself when it survives pickling, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


__all__ = ["ProcessAsyncLLM", "serve_engine_core"]
