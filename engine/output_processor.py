"""Tokens to deltas: incremental detokenization, stop strings, n > 1 fan-in.

Each step turns the sampled tokens into one `GenerateDelta` per request that got tokens: the new token
ids, the new text, their logprobs and, at the end, the finish reason. The work and the size of what it
emits are O(1) per sampled token, whatever the position in the output: nothing cumulative is kept but a
bounded tail of text that could still become a stop string (and the detokenizer's small window).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.plan import SampledToken
from engine.request import Request, RequestStatus
from tokenization.tokenizer import IncrementalDetokenizer, Tokenizer
from wire.protocol import GenerateDelta, Logprob, SampleDelta
from wire.sampling import SamplingParams


@dataclass
class _Child:
    request_id: str  # the scheduler's id for this sample
    index: int
    detok: IncrementalDetokenizer
    pending: str = ""  # decoded text not yet emitted: at most `hold` chars between steps
    finished: bool = False


@dataclass
class _Parent:
    request_id: str
    num_prompt_tokens: int
    params: SamplingParams
    children: list[_Child] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_unfinished: int = 0

    @property
    def longest_stop(self) -> int:
        return max((len(s) for s in self.params.stop), default=0)


class OutputProcessor:
    """Turns each step's sampled tokens into deltas. Tells the caller which requests hit a stop string.

    Holds, per running sample, only its detokenizer window and the text held back for stop strings
    (shorter than the longest stop string). Mutated only by the engine loop.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, tuple[_Parent, _Child]] = {}

    def add(self, parent_id: str, prompt_token_ids: list[int], params: SamplingParams,
            child_ids: list[str]) -> None:
        parent = _Parent(parent_id, len(prompt_token_ids), params, num_unfinished=len(child_ids))
        for i, cid in enumerate(child_ids):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
            child = _Child(cid, i, detok)
            parent.children.append(child)
            self._child_to_parent[cid] = (parent, child)
        self._parents[parent_id] = parent

    def child_ids(self, parent_id: str) -> list[str]:
        parent = self._parents.get(parent_id)
        return [c.request_id for c in parent.children] if parent else []

    def parent_of(self, child_id: str) -> str | None:
        entry = self._child_to_parent.get(child_id)
        return entry[0].request_id if entry else None

    def has(self, parent_id: str) -> bool:
        return parent_id in self._parents

    def parent_ids(self) -> list[str]:
        """The requests with a sample still unfinished (their callers still wait for a delta)."""
        return list(self._parents)

    def process(self, updates: list[tuple[Request, SampledToken]]
                ) -> tuple[list[GenerateDelta], list[tuple[str, str]]]:
        """Apply one step's tokens. Returns (deltas, stop-string hits as (child id, stop string)).

        A stop-string hit is already reflected as finish_reason "stop" in the deltas; the caller must
        end that child in the scheduler. A request whose samples all finished is forgotten.
        """
        touched: dict[str, tuple[_Parent, list[SampleDelta]]] = {}
        hits: list[tuple[str, str]] = []
        for req, sampled in updates:
            entry = self._child_to_parent.get(req.request_id)
            if entry is None or entry[1].finished:
                continue
            parent, child = entry
            parent.num_cached_tokens = max(parent.num_cached_tokens, req.num_cached_tokens)
            sample, stop = self._advance(parent, child, req, sampled)
            if stop is not None:
                hits.append((req.request_id, stop))
            touched.setdefault(parent.request_id, (parent, []))[1].append(sample)
        return [self._delta(parent, samples) for parent, samples in touched.values()], hits

    def finish(self, parent_id: str, status: RequestStatus) -> GenerateDelta | None:
        """Every unfinished sample of the request ends now with `status` (an abort). Returns the final
        delta (with any held-back text), or None if the request is unknown or already finished."""
        parent = self._parents.get(parent_id)
        if parent is None:
            return None
        samples = []
        for child in parent.children:
            if not child.finished:
                samples.append(SampleDelta(child.index, [], child.pending, finish_reason=status.finish_reason))
                self._finish_child(parent, child)
        return self._delta(parent, samples)

    def drop(self, parent_id: str) -> bool:
        """Forget a request (it failed; its caller gets an error, not a delta). False if unknown."""
        parent = self._parents.pop(parent_id, None)
        if parent is None:
            return False
        for child in parent.children:
            self._child_to_parent.pop(child.request_id, None)
        return True

    # ----- one token --------------------------------------------------------------------------------

    def _advance(self, parent: _Parent, child: _Child, req: Request,
                 sampled: SampledToken) -> tuple[SampleDelta, str | None]:
        params = parent.params
        logprobs = None
        if params.logprobs is not None:
            logprobs = [] if sampled.logprob is None else [
                Logprob(sampled.token_id, sampled.logprob, tuple(sampled.top_logprobs or ()))]
        added = child.detok.add([sampled.token_id])
        text = child.pending + added  # NOTE: bounded: pending is shorter than the longest stop string
        stop = self._find_stop(text, len(added), params, parent.longest_stop)
        finish_reason: str | None = None
        stop_reason: int | str | None = None
        if stop is not None:
            pos, s = stop
            text = text[: pos + len(s)] if params.include_stop_str_in_output else text[:pos]
            child.pending = ""
            finish_reason, stop_reason = "stop", s
        elif req.status.finished:
            text, child.pending = text + child.detok.flush(), ""
            finish_reason, stop_reason = req.status.finish_reason, req.stop_reason
        else:
            # While running, hold back text that could still turn into a stop string.
            cut = max(0, len(text) - max(0, parent.longest_stop - 1))
            text, child.pending = text[:cut], text[cut:]
        if finish_reason is not None:
            self._finish_child(parent, child)
        sample = SampleDelta(child.index, [sampled.token_id], text, logprobs, finish_reason, stop_reason)
        return sample, stop[1] if stop is not None else None

    @staticmethod
    def _find_stop(text: str, added: int, params: SamplingParams, longest: int) -> tuple[int, str] | None:
        """The earliest stop string that ends inside the newly added (last `added` chars of) text."""
        if not params.stop or added == 0:
            return None
        window_start = max(0, len(text) - added - longest + 1)
        best: tuple[int, str] | None = None
        for s in params.stop:
            pos = text.find(s, window_start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        return best

    def _finish_child(self, parent: _Parent, child: _Child) -> None:
        child.finished = True
        parent.num_unfinished -= 1

    def _delta(self, parent: _Parent, samples: list[SampleDelta]) -> GenerateDelta:
        finished = parent.num_unfinished == 0
        if finished:
            self.drop(parent.request_id)
        return GenerateDelta(parent.request_id, samples, parent.num_prompt_tokens, parent.num_cached_tokens,
                             finished)
