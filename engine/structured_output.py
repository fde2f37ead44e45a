"""Structured output in the engine: compile off the loop, gate admission, mask logits, advance matchers.

Flow per constrained request: `submit` at add_request (the cheap strictness checks run now, so an
unsupported schema is refused at submission; the compile runs on the grammar package's thread pool);
`poll` before each schedule hands finished compiles to their requests (`admission_gate`, one of the
scheduler's gates, keeps a request waiting, without holding up others, until its grammar is ready); the
runner calls `fill` to build one batched bitmask for
the constrained rows of a step; the scheduler advances each matcher with the sampled token and finishes
the request with "stop" once the automaton is complete; `guard` then validates each output that finished
"stop" against the spec it was asked for, before the output processor turns it into text for the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.plan import SampledToken, SampleRow
from engine.request import Request, RequestStatus
from engine.scheduler import BASE_SLOT
from grammar import (
    DEFAULT_BACKEND,
    CompiledGrammar,
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    TokenizerInfo,
    allocate_bitmask,
    fill_bitmasks,
)
from grammar.tool_calls import ToolCallsSpec, ToolEntry
from tokenization.tool_formats import tool_format
from wire.sampling import InvalidSamplingParams, SamplingParams

log = logging.getLogger(__name__)

# Deepest JSON nesting (objects and arrays) of a schema a request may give; a schema nested 64 levels of
# properties is already 128 deep here. Deeper ones are refused at submission, before any compile.
MAX_SCHEMA_DEPTH = 256
# What a request whose finished output failed the guard is told (the detail goes to the log, with the digest).
GUARD_ERROR = "internal error: the constrained output did not validate against the requested schema"


def spec_for(params: SamplingParams, special_tokens: Mapping[str, int] | None = None) -> GrammarSpec | None:
    """The grammar a request asks for, or None. Raises GrammarError for an invalid spec.

    `special_tokens` (text → id) lets a tool call grammar write its format's special-token markers
    (`<|python_tag|>`, `[TOOL_CALLS]`) as those tokens."""
    if params.tool_calls is not None:
        return tool_calls_spec(params, special_tokens or {})
    if params.json_schema is not None:
        return GrammarSpec.json_schema(params.json_schema)
    if params.json_object:
        return GrammarSpec.json_object()
    if params.regex is not None:
        return GrammarSpec.regex(params.regex)
    if params.choice is not None:
        return GrammarSpec.choice(list(params.choice))
    return None


def tool_calls_spec(params: SamplingParams, special_tokens: Mapping[str, int]) -> GrammarSpec:
    """The "tool_calls" grammar of a request: its constraint, the answer schema of auto mode (json_schema
    or json_object), and the vocabulary's special tokens that the format's markers use."""
    constraint = params.tool_calls
    assert constraint is not None
    try:
        fmt = tool_format(constraint.format)
    except ValueError as e:
        raise GrammarError(str(e)) from None
    answer = None
    if params.json_schema is not None:
        answer = GrammarSpec.json_schema(params.json_schema).schema()
    elif params.json_object:
        answer = GrammarSpec.json_object().schema()
    markup = fmt.trigger + fmt.open + fmt.separator + fmt.close
    spec = ToolCallsSpec(fmt.name, tuple(ToolEntry(t.index, t.name, t.parameters) for t in constraint.tools),
                         constraint.mode, constraint.parallel, answer,
                         {text: i for text, i in special_tokens.items() if text in markup})
    return GrammarSpec.tool_calls(spec.to_json())


@dataclass
class GuardStats:
    """Finished constrained outputs validated, and those that failed (each one a grammar bug)."""

    checked: int = 0
    failed: int = 0


class StructuredOutputManager:
    def __init__(self, model_dir: str | Path, eos_token_ids: tuple[int, ...], backend: str | None = None) -> None:
        info = TokenizerInfo.from_file(model_dir, eos_token_ids=list(eos_token_ids))
        self.tokenizer_info = info
        self.special_tokens = _special_tokens(model_dir)  # text -> id, for tool call markers
        self.guard_stats = GuardStats()
        self.vocab_size = info.vocab_size
        self.compiler = GrammarCompiler(info, backend=backend or DEFAULT_BACKEND)
        self._pending: dict[str, tuple[Request, Future[CompiledGrammar]]] = {}
        self._bitmask = allocate_bitmask(8, self.vocab_size)

    def submit(self, req: Request) -> None:
        """Start compiling req's grammar. Raises InvalidSamplingParams (a ValueError) naming the body's
        param ("response_format", "tools[i].function.parameters") if the spec is refused."""
        params = req.sampling_params
        too_deep = _too_deep(params)
        if too_deep is not None:
            raise InvalidSamplingParams(too_deep, f"{too_deep}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        try:
            spec = spec_for(params, self.special_tokens)
            if spec is None:
                return
            future = self.compiler.submit(spec)
        except GrammarError as e:
            raise InvalidSamplingParams(_refused_param(params, e), str(e)) from None
        except RecursionError:  # a schema text deeper than the depth check sees (a JSON string)
            raise InvalidSamplingParams("response_format", "the schema is nested too deeply") from None
        self._pending[req.request_id] = (req, future)

    def admission_gate(self, req: Request, active_slots: set[int]) -> int | None:
        """Scheduler gate: a constrained request waits (None) until `poll` attached its matcher. Only looks."""
        if req.sampling_params.has_grammar and req.grammar is None:
            return None
        return BASE_SLOT

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def poll(self) -> list[tuple[Request, str]]:
        """Attach finished compiles to their requests. Returns (request, error) for failed compiles."""
        failed = []
        for rid, (req, fut) in list(self._pending.items()):
            if not fut.done():
                continue
            del self._pending[rid]
            try:
                req.grammar = fut.result().matcher()
            except GrammarError as e:
                failed.append((req, str(e)))
        return failed

    def fill(self, rows: list[SampleRow]) -> tuple[torch.Tensor, list[int]] | None:
        """One batched bitmask fill for this step's constrained rows: (bitmask, their row indices)."""
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if not constrained:
            return None
        if self._bitmask.shape[0] < len(constrained):
            self._bitmask = allocate_bitmask(max(len(constrained), 2 * self._bitmask.shape[0]), self.vocab_size)
        fill_bitmasks([rows[i].grammar for i in constrained], self._bitmask)  # type: ignore[misc]
        return self._bitmask, constrained

    def guard(self, updates: list[tuple[Request, SampledToken]]) -> list[tuple[str, str]]:
        """Validate every constrained output that this step finished with "stop"; returns (request id,
        error) for those that fail. The caller must not report them as "stop": it fails them instead (the
        scheduler has already released them) with this error. Counts into `guard_stats`; logs each failure
        with the spec's digest. Mutates nothing else.

        Outputs that ended "length" or "abort" are incomplete by definition and not checked.
        """
        failures = []
        for req, _ in updates:
            matcher = req.grammar
            if matcher is None or req.status != RequestStatus.FINISHED_STOPPED or matcher.grammar.guard is None:
                continue
            self.guard_stats.checked += 1
            problem = self._check(req)
            if problem is not None:
                self.guard_stats.failed += 1
                log.error("constrained output failed its guard: request %s, spec %s digest %s: %s", req.request_id,
                          matcher.grammar.spec.kind, matcher.grammar.guard.digest, problem)
                failures.append((req.request_id, GUARD_ERROR))
        return failures

    def _check(self, req: Request) -> str | None:
        """Why req's output (its token bytes; a final EOS or special stop token left out) fails its guard."""
        info = self.tokenizer_info
        ids = list(req.output_token_ids)
        if ids and info.token_bytes[ids[-1]] is None and (ids[-1] in info.eos_token_ids
                                                          or ids[-1] in req.sampling_params.stop_token_ids):
            ids.pop()
        pieces = [info.token_bytes[i] if 0 <= i < info.vocab_size else None for i in ids]
        if req.sampling_params.tool_calls is not None:  # its format's markers may be special tokens
            names = {i: t.encode() for t, i in self.special_tokens.items()}
            pieces = [names.get(i) if p is None else p for i, p in zip(ids, pieces, strict=True)]
        if any(p is None for p in pieces):
            return "the output holds a special token"
        try:
            text = b"".join(pieces).decode("utf-8")  # type: ignore[arg-type]
        except UnicodeDecodeError:
            return "the output is not valid UTF-8"
        return req.grammar.grammar.guard.check(text)  # type: ignore[union-attr]

    def shutdown(self) -> None:
        self.compiler.shutdown()


def _special_tokens(model_dir: str | Path) -> dict[str, int]:
    """The vocabulary's special added tokens, by their text."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return {t.content: int(i) for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}


def _too_deep(params: SamplingParams) -> str | None:
    """The body param whose schema nests deeper than MAX_SCHEMA_DEPTH (iteratively: a deep document must
    not exhaust the stack here either), or None."""
    schemas = []
    if isinstance(params.json_schema, dict):
        schemas.append(("response_format", params.json_schema))
    if params.tool_calls is not None:
        schemas += [(f"tools[{t.index}].function.parameters", t.parameters) for t in params.tool_calls.tools]
    for param, schema in schemas:
        stack: list[tuple[dict | list, int]] = [(schema, 1)]
        while stack:
            node, depth = stack.pop()
            if depth > MAX_SCHEMA_DEPTH:
                return param
            children = node.values() if isinstance(node, dict) else node
            stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return None


def _refused_param(params: SamplingParams, error: GrammarError) -> str:
    """The body param a refused grammar came from: the one the grammar names (a tool's parameters), else
    the request's tools for a tool call grammar, else response_format."""
    if error.param is not None:
        return error.param
    return "tools" if params.tool_calls is not None else "response_format"
