"""Compile grammars off the engine loop: a thread pool, an LRU cache, a time and a size limit.

The engine calls `submit(spec)` when a request arrives and keeps scheduling other requests; the
request waits in the scheduler until its future is done (`future.done()` is a cheap poll), then
builds its matcher with `future.result().matcher()`. A failed future holds a GrammarError whose
message names the problem (and the JSON pointer for schemas).
"""

from __future__ import annotations

import heapq
import json
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field

from grammar.backend import CompiledGrammar, GrammarBackend, GrammarLimits
from grammar.formats import rust_regex_error
from grammar.guard import OutputGuard
from grammar.llguidance_backend import LLGuidanceBackend
from grammar.locate import existing_prefix, locate
from grammar.normalize import NormalizedSchema, normalize_schema
from grammar.outlines_backend import OutlinesBackend
from grammar.refs import schema_error
from grammar.spec import BackendRefusal, GrammarError, GrammarSpec
from grammar.tokenizer_info import TokenizerInfo
from grammar.tool_calls import ToolCallGuard, ToolCallsSpec, normalize_tool_calls

BACKENDS: dict[str, type[GrammarBackend]] = {"llguidance": LLGuidanceBackend, "outlines": OutlinesBackend}
# Chosen by measurement (bench/grammar.py): fastest cold compile and the widest strict coverage.
DEFAULT_BACKEND = "llguidance"


@dataclass
class CompileStats:
    """Counters since the compiler was made (for metrics). Updated under the compiler's lock.

    accepted / refused: json_schema specs that passed / failed normalization and compile (cache hits
    not counted). ignored_formats: unknown formats dropped as annotations, by value. approximations:
    keywords left to the output guard, by keyword. rewrites: exact rewrites applied, by kind.
    """

    accepted: int = 0
    refused: int = 0
    ignored_formats: Counter[str] = field(default_factory=Counter)
    approximations: Counter[str] = field(default_factory=Counter)
    rewrites: Counter[str] = field(default_factory=Counter)
    evicted_broken: int = 0  # cached grammars dropped because a matcher found them broken (backend.py)


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one tokenizer with one backend; thread-safe.

    Cache key: (canonical spec, tokenizer fingerprint, backend name). Only successes are cached;
    a failure is re-reported (and recompiled) on each submit. A compile that runs past `timeout_s`
    fails its future with GrammarError; the worker thread finishes in the background (a native
    compile cannot be interrupted) and its result is dropped. Each compiled grammar carries the
    `OutputGuard` of its spec. `allow_approximate`: see grammar/normalize.py.
    """

    def __init__(self, tokenizer_info: TokenizerInfo, backend: str = DEFAULT_BACKEND, max_workers: int = 2,
                 timeout_s: float = 10.0, cache_size: int = 256, limits: GrammarLimits | None = None,
                 allow_approximate: bool = True) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown grammar backend {backend!r}; choose one of {sorted(BACKENDS)}")
        if max_workers < 1 or cache_size < 1 or not timeout_s > 0:
            raise ValueError("max_workers and cache_size must be >= 1 and timeout_s > 0")
        self.tokenizer_info = tokenizer_info
        self.limits = limits or GrammarLimits()
        self.backend: GrammarBackend = BACKENDS[backend](tokenizer_info, self.limits)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.allow_approximate = allow_approximate
        self.stats = CompileStats()
        self._cache: OrderedDict[tuple[str, str, str, str], CompiledGrammar] = OrderedDict()
        self._pending: dict[tuple[str, str, str, str], Future[CompiledGrammar]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._watchdog = _Watchdog()
        self.cache_hits = 0
        self.cache_misses = 0

    def _key(self, spec: GrammarSpec) -> tuple[str, str, str, str]:
        return (spec.kind, spec.value, self.tokenizer_info.fingerprint, self.backend.name)

    def check(self, spec: GrammarSpec) -> NormalizedSchema | None:
        """The synchronous checks (size, normalization); raise GrammarError. Run at submission.
        Returns the normalized schema for json_schema / json_object specs."""
        if len(spec.value) > self.limits.max_spec_chars:
            raise GrammarError(f"{spec.kind} is too large: {len(spec.value)} characters, "
                               f"{len(spec.value) - self.limits.max_spec_chars} over the limit of "
                               f"{self.limits.max_spec_chars} (GrammarLimits.max_spec_chars)")
        if spec.kind in ("json_schema", "json_object"):
            return normalize_schema(spec.schema(), self.backend, self.limits, self.allow_approximate)
        if spec.kind == "tool_calls":  # every tool's schema under the same strictness as json_schema
            return normalize_tool_calls(ToolCallsSpec.from_json(json.loads(spec.value)),
                                        lambda s: normalize_schema(s, self.backend, self.limits, self.allow_approximate))
        if spec.kind == "regex":
            # Both backends take Rust regex syntax; llguidance's parser checks it in about a millisecond.
            error = rust_regex_error(spec.value)
            if error:
                raise GrammarError(f"invalid regex {spec.value!r}: {error}")
        return None

    def _build(self, spec: GrammarSpec, normalized: NormalizedSchema | None) -> CompiledGrammar:
        """Pool thread: compile, attach the output guard and the normalization report. A backend's own
        refusal of a JSON schema is re-raised naming the pointer it concerns."""
        try:
            compiled = self.backend.compile(spec, None if normalized is None else normalized.schema)
        except BackendRefusal as e:
            if spec.kind != "json_schema" or normalized is None:
                raise
            pointer, detail = locate(e.detail, normalized.schema, normalized.report.def_pointers, self.backend.too_large)
            pointer = existing_prefix(spec.schema(), pointer)
            raise schema_error(pointer, f"refused by the {e.backend} backend: {detail}") from None
        compiled.guard = ToolCallGuard(spec) if spec.kind == "tool_calls" else OutputGuard(spec)
        compiled.report = None if normalized is None else normalized.report
        return compiled

    def _count(self, spec: GrammarSpec, normalized: NormalizedSchema | None, ok: bool) -> None:
        if spec.kind != "json_schema":
            return
        with self._lock:
            if not ok:
                self.stats.refused += 1
                return
            self.stats.accepted += 1
            if normalized is not None:
                self.stats.ignored_formats.update(normalized.report.ignored_formats)
                self.stats.approximations.update(normalized.report.approximations)
                self.stats.rewrites.update(normalized.report.rewrites)

    def submit(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """Start compiling `spec` (or find it cached / in flight); never blocks on a compile.

        The strictness check runs here, so an unsupported schema fails at submission with the
        GrammarError raised directly.
        """
        key = self._key(spec)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and cached.broken is not None:  # its matchers would fail: compile it again
                del self._cache[key]
                self.stats.evicted_broken += 1
                cached = None
            if cached is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                done: Future[CompiledGrammar] = Future()
                done.set_result(cached)
                return done
            if key in self._pending:
                return self._pending[key]
            self.cache_misses += 1
        try:
            normalized = self.check(spec)
        except GrammarError:
            self._count(spec, None, ok=False)
            raise
        outer: Future[CompiledGrammar] = Future()
        with self._lock:
            if key in self._pending:
                return self._pending[key]
            self._pending[key] = outer
        started = time.monotonic()
        inner = self._pool.submit(self._build, spec, normalized)
        self._watchdog.watch(started + self.timeout_s, lambda: self._expire(key, outer, spec))
        inner.add_done_callback(lambda f: self._finish(key, outer, f, started, normalized))
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

    def _finish(self, key, outer: Future[CompiledGrammar], inner: Future, started: float,
                normalized: NormalizedSchema | None) -> None:
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
        self._count(GrammarSpec(key[0], key[1]), normalized, ok=error is None)
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
