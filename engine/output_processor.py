"""Tokens to text: incremental detokenization, stop strings, n > 1 fan-in, RequestOutputs."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.plan import SampledToken
from engine.request import Request, RequestStatus
from tokenization.tokenizer import IncrementalDetokenizer, Tokenizer
from wire.sampling import SamplingParams


@dataclass
class _Child:
    request_id: str  # the scheduler's id for this sample
    detok: IncrementalDetokenizer
    out: CompletionOutput
    emitted: int = 0  # characters of out.text already streamed


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[_Child] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(c.out.finished for c in self.children)


class OutputProcessor:
    """Turns each step's sampled tokens into RequestOutputs. Tells the caller which requests hit a stop string."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, tuple[_Parent, _Child]] = {}

    def add(self, parent_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            child_ids: list[str]) -> None:
        parent = _Parent(parent_id, prompt, prompt_token_ids, params)
        for i, cid in enumerate(child_ids):
            child = _Child(cid, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens),
                           CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None))
            parent.children.append(child)
            self._child_to_parent[cid] = (parent, child)
        self._parents[parent_id] = parent

    def child_ids(self, parent_id: str) -> list[str]:
        parent = self._parents.get(parent_id)
        return [c.request_id for c in parent.children] if parent else []

    def has(self, parent_id: str) -> bool:
        return parent_id in self._parents

    def process(self, updates: list[tuple[Request, SampledToken]]) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Apply one step's tokens. Returns (outputs, stop-string hits as (child id, stop string)).

        A stop-string hit is already reflected as finish_reason "stop" in the outputs; the caller must
        end that child in the scheduler.
        """
        touched: dict[str, _Parent] = {}
        hits: list[tuple[str, str]] = []
        for req, sampled in updates:
            entry = self._child_to_parent.get(req.request_id)
            if entry is None:
                continue
            parent, child = entry
            parent.num_cached_tokens = max(parent.num_cached_tokens, req.num_cached_tokens)
            out = child.out
            if out.finished:
                continue
            out.token_ids.append(sampled.token_id)
            out.delta_token_ids.append(sampled.token_id)
            if out.logprobs is not None and sampled.logprob is not None:
                lp = Logprob(sampled.token_id, sampled.logprob, sampled.top_logprobs or [])
                out.logprobs.append(lp)
                out.delta_logprobs.append(lp)
            added = child.detok.add([sampled.token_id])
            out.text += added
            stop = self._check_stop_strings(out, parent.params, len(added))
            if stop is not None:
                hits.append((req.request_id, stop))
                out.finish_reason, out.stop_reason = "stop", stop
            elif req.status.finished:
                out.text += child.detok.flush()
                out.finish_reason, out.stop_reason = req.status.finish_reason, req.stop_reason
            touched[parent.request_id] = parent
        return [self._emit(p) for p in touched.values()], hits

    def finish(self, child_id: str, status: RequestStatus, error: str | None = None) -> RequestOutput | None:
        """A child ended outside a step (abort, error). Returns the parent's output if it changed."""
        entry = self._child_to_parent.get(child_id)
        if entry is None:
            return None
        parent, child = entry
        if child.out.finished:
            return None
        child.out.finish_reason = status.finish_reason
        if error:
            parent.error = error
        return self._emit(parent)

    @staticmethod
    def _check_stop_strings(out: CompletionOutput, params: SamplingParams, added: int) -> str | None:
        """Find the earliest stop string that ends inside the newly added text; truncate the text there."""
        if not params.stop or added == 0:
            return None
        longest = max(len(s) for s in params.stop)
        window_start = max(0, len(out.text) - added - longest + 1)
        best: tuple[int, str] | None = None
        for s in params.stop:
            pos = out.text.find(s, window_start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return None
        pos, s = best
        out.text = out.text[: pos + len(s)] if params.include_stop_str_in_output else out.text[:pos]
        return s

    def _emit(self, parent: _Parent) -> RequestOutput:
        hold = max((len(s) for s in parent.params.stop), default=1) - 1
        outputs = []
        for child in parent.children:
            out = child.out
            # While running, hold back text that could still turn into a stop string.
            visible = len(out.text) if out.finished else max(child.emitted, len(out.text) - hold)
            out.delta_text = out.text[child.emitted : visible]
            child.emitted = visible
            snapshot = copy.copy(out)
            snapshot.text = out.text[:visible]
            snapshot.token_ids = list(out.token_ids)
            snapshot.logprobs = list(out.logprobs) if out.logprobs is not None else None
            outputs.append(snapshot)
            out.delta_token_ids = []
            out.delta_logprobs = []
        finished = parent.finished
        if finished:
            self._parents.pop(parent.request_id, None)
            for child in parent.children:
                self._child_to_parent.pop(child.request_id, None)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs, finished,
                             parent.num_cached_tokens, parent.error)
