"""Structured output in the engine: compile off the loop, gate admission, mask logits, advance matchers.

Flow per constrained request: `submit` at add_request (the cheap strictness checks run now, so an
unsupported schema is refused at submission; the compile runs on the grammar package's thread pool);
`poll` before each schedule hands finished compiles to their requests (a request stays waiting, without
holding up others, until its grammar is ready); the runner calls `fill` to build one batched bitmask for
the constrained rows of a step; the scheduler advances each matcher with the sampled token and finishes
the request with "stop" once the automaton is complete.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import torch

from engine.plan import SampleRow
from engine.request import Request
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
from wire.sampling import SamplingParams


def spec_for(params: SamplingParams) -> GrammarSpec | None:
    """The grammar a request asks for, or None. Raises GrammarError for an invalid spec."""
    if params.json_schema is not None:
        return GrammarSpec.json_schema(params.json_schema)
    if params.json_object:
        return GrammarSpec.json_object()
    if params.regex is not None:
        return GrammarSpec.regex(params.regex)
    if params.choice is not None:
        return GrammarSpec.choice(list(params.choice))
    return None


class StructuredOutputManager:
    def __init__(self, model_dir: str | Path, eos_token_ids: tuple[int, ...], backend: str | None = None) -> None:
        info = TokenizerInfo.from_file(model_dir, eos_token_ids=list(eos_token_ids))
        self.vocab_size = info.vocab_size
        self.compiler = GrammarCompiler(info, backend=backend or DEFAULT_BACKEND)
        self._pending: dict[str, tuple[Request, Future[CompiledGrammar]]] = {}
        self._bitmask = allocate_bitmask(8, self.vocab_size)

    def submit(self, req: Request) -> None:
        """Start compiling req's grammar. Raises GrammarError (a ValueError) if the spec is refused."""
        spec = spec_for(req.sampling_params)
        if spec is None:
            return
        self._pending[req.request_id] = (req, self.compiler.submit(spec))

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

    def shutdown(self) -> None:
        self.compiler.shutdown()
