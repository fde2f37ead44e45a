"""Compile grammars off the engine loop: a thread pool, an LRU cache, a time and a size limit.

The engine calls `submit(spec)` when a request arrives and keeps scheduling other requests; the
request waits in the scheduler until its future is done (`future.done()` is a cheap poll), then
builds its matcher with `future.result().matcher()`. A failed future holds a GrammarError whose
message names the problem (and the JSON pointer for schemas).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor

import llguidance

from grammar.backend import CompiledGrammar, GrammarBackend, GrammarLimits
from grammar.llguidance_backend import LLGuidanceBackend
from grammar.outlines_backend import OutlinesBackend
from grammar.spec import GrammarError, GrammarSpec
from grammar.strictness import check_schema
from grammar.tokenizer_info import TokenizerInfo

BACKENDS: dict[str, type[GrammarBackend]] = {"llguidance": LLGuidanceBackend, "outlines": OutlinesBackend}
# Chosen by measurement (bench/grammar.py): fastest cold compile and the widest strict coverage.
DEFAULT_BACKEND = "llguidance"


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one tokenizer with one backend; thread-safe.

    Cache key: (canonical spec, tokenizer fingerprint, backend name). Only successes are cached;
    a failure is re-reported (and recompiled) on each submit. A compile that runs past `timeout_s`
    fails its future with GrammarError; the worker thread finishes in the background (a native
    compile cannot be interrupted) and its result is dropped.
    """

    def __init__(self, tokenizer_info: TokenizerInfo, backend: str = DEFAULT_BACKEND, max_workers: int = 2,
                 timeout_s: float = 10.0, cache_size: int = 256, limits: GrammarLimits | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown grammar backend {backend!r}; choose one of {sorted(BACKENDS)}")
        if max_workers < 1 or cache_size < 1 or not timeout_s > 0:
            raise ValueError("max_workers and cache_size must be >= 1 and timeout_s > 0")
        self.tokenizer_info = tokenizer_info
        self.limits = limits or GrammarLimits()
        self.backend: GrammarBackend = BACKENDS[backend](tokenizer_info, self.limits)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str, str, str], CompiledGrammar] = OrderedDict()
        self._pending: dict[tuple[str, str, str, str], Future[CompiledGrammar]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._watchdog = _Watchdog()
        self.cache_hits = 0
        self.cache_misses = 0

    def _key(self, spec: GrammarSpec) -> tuple[str, str, str, str]:
        return (spec.kind, spec.value, self.tokenizer_info.fingerprint, self.backend.name)

    def check(self, spec: GrammarSpec) -> None:
        """The cheap synchronous checks (size, strictness); raise GrammarError. Run at submission."""
        if len(spec.value) > self.limits.max_spec_chars:
            raise GrammarError(f"{spec.kind} is too large: {len(spec.value)} characters "
                               f"(limit {self.limits.max_spec_chars})")
        if spec.kind == "json_schema":
            check_schema(spec.schema(), self.backend, self.limits.max_ref_depth)
        elif spec.kind == "regex":
            # Both backends take Rust regex syntax; llguidance's parser checks it in about a millisecond.
            error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_regex(spec.value))
            if error:
                detail = next((ln.strip() for ln in error.splitlines() if ln.strip().startswith("error:")), "")
                raise GrammarError(f"invalid regex {spec.value!r}: {detail.removeprefix('error: ') or error}")

    def submit(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """Start compiling `spec` (or find it cached / in flight); never blocks on a compile.

        The strictness check runs here, so an unsupported schema fails at submission with the
        GrammarError raised directly.
        """
        key = self._key(spec)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                done: Future[CompiledGrammar] = Future()
                done.set_result(cached)
                return done
            if key in self._pending:
                return self._pending[key]
            self.cache_misses += 1
        self.check(spec)
        outer: Future[CompiledGrammar] = Future()
        with self._lock:
            if key in self._pending:
                return self._pending[key]
            self._pending[key] = outer
        started = time.monotonic()
        inner = self._pool.submit(self.backend.compile, spec)
        self._watchdog.watch(started + self.timeout_s, lambda: self._expire(key, outer, spec))
        inner.add_done_callback(lambda f: self._finish(key, outer, f, started))
        return outer

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Synchronous compile (tests, the offline API): waits for `submit(spec)`."""
        return self.submit(spec).result()

    def _expire(self, key: tuple[str, str, str, str], outer: Future[CompiledGrammar], spec: GrammarSpec) -> None:
        with self._lock:
            if self._pending.get(key) is outer:
                del self._pending[key]
        self._settle(outer, error=GrammarError(
            f"{spec.kind} took longer than the compile time limit of {self.timeout_s:g} s"))

    def _finish(self, key, outer: Future[CompiledGrammar], inner: Future, started: float) -> None:
        error = inner.exception()
        if error is None and time.monotonic() - started > self.timeout_s:
            error = GrammarError(f"{key[0]} took longer than the compile time limit of {self.timeout_s:g} s")
        with self._lock:
            if self._pending.get(key) is outer:
                del self._pending[key]
            if error is None and not outer.done():
                self._cache[key] = inner.result()
                self._cache.move_to_end(key)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if error is not None and not isinstance(error, GrammarError):
            error = GrammarError(f"{key[0]} failed to compile: {type(error).__name__}: {error}")
        self._settle(outer, result=None if error else inner.result(), error=error)

    @staticmethod
    def _settle(outer: Future, result: CompiledGrammar | None = None, error: BaseException | None = None) -> None:
        try:
            if error is not None:
                outer.set_exception(error)
            else:
                outer.set_result(result)
        except InvalidStateError:  # already settled by the other of timer and worker: first one wins
            pass

    def num_cached(self) -> int:
        with self._lock:
            return len(self._cache)

    def shutdown(self) -> None:
        """Stop accepting work; running compiles finish in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._watchdog.stop()


class _Watchdog:
    """One daemon thread that runs each callback at its deadline (a Timer thread per compile
    costs more than a whole llguidance compile). Callbacks must tolerate running after the work
    is done: `_expire` only settles a future nobody settled yet."""

    def __init__(self) -> None:
        self._deadlines: list[tuple[float, int, Callable[[], None]]] = []
        self._wake = threading.Condition()
        self._count = 0
        self._stopped = False
        threading.Thread(target=self._run, name="grammar-watchdog", daemon=True).start()

    def watch(self, deadline: float, callback: Callable[[], None]) -> None:
        with self._wake:
            self._count += 1
            heapq.heappush(self._deadlines, (deadline, self._count, callback))
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and (not self._deadlines or self._deadlines[0][0] > time.monotonic()):
                    self._wake.wait(self._deadlines[0][0] - time.monotonic() if self._deadlines else None)
                if self._stopped:
                    return
                _, _, callback = heapq.heappop(self._deadlines)
            callback()
