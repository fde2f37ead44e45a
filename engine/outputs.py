"""What the offline `LLM.generate()` returns (vLLM-compatible shapes), accumulated from the engine's deltas.

The engine emits only deltas (wire.protocol.GenerateDelta); the offline API is the one caller that asks
for whole outputs, so `OutputAccumulator` sums a request's deltas here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wire.errors import RequestError
from wire.protocol import GenerateDelta, Logprob


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        return sum(lp.logprob for lp in self.logprobs) if self.logprobs is not None else None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None  # the engine failed the request (its samples end with "error")


class OutputAccumulator:
    """One request's deltas summed into a RequestOutput. O(new tokens) per `add`; text joins at `output`."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], n: int,
                 with_logprobs: bool) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self._pieces: list[list[str]] = [[] for _ in range(n)]
        self._outputs = [CompletionOutput(i, logprobs=[] if with_logprobs else None) for i in range(n)]
        self.num_cached_tokens = 0
        self.finished = False
        self.error: str | None = None

    def add(self, delta: GenerateDelta) -> None:
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        for s in delta.samples:
            out = self._outputs[s.index]
            out.token_ids.extend(s.token_ids)
            if s.text:
                self._pieces[s.index].append(s.text)
            if out.logprobs is not None and s.logprobs:
                out.logprobs.extend(s.logprobs)
            if s.finish_reason is not None:
                out.finish_reason, out.stop_reason = s.finish_reason, s.stop_reason
        self.finished = self.finished or delta.finished

    def fail(self, error: RequestError) -> None:
        """The request failed: every unfinished sample ends with "error"."""
        self.error = error.message
        self.finished = True
        for out in self._outputs:
            if out.finish_reason is None:
                out.finish_reason = "error"

    def output(self) -> RequestOutput:
        for out, pieces in zip(self._outputs, self._pieces, strict=True):
            if pieces:
                out.text += "".join(pieces)
                pieces.clear()
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self._outputs, self.finished,
                             self.num_cached_tokens, self.error)
