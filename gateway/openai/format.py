"""Engine deltas → OpenAI response objects: chat.completion(.chunk) and text_completion.

A `Formatter` knows one endpoint's shapes; `Accumulator` sums deltas for non-streaming answers and for
usage. Logprobs use the tokenizer to name tokens; -inf becomes -9999.0 as in OpenAI's API (JSON has no
infinity).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from wire.protocol import GenerateDelta, SampleDelta, TokenLogprob

MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return MIN_LOGPROB if not math.isfinite(value) else max(value, MIN_LOGPROB)


@dataclass
class SampleState:
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    started: bool = False  # the first (role) chunk went out


class Accumulator:
    def __init__(self, n: int) -> None:
        self.samples = [SampleState() for _ in range(n)]
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def add(self, delta: GenerateDelta) -> None:
        self.prompt_tokens = delta.num_prompt_tokens
        self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens)
        for s in delta.samples:
            state = self.samples[s.index]
            state.text += s.text
            state.num_tokens += len(s.token_ids)
            state.logprobs.extend(s.logprobs or [])
            state.finish_reason = s.finish_reason or state.finish_reason

    @property
    def completion_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def openai_finish_reason(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length"}.get(reason or "", None if reason is None else "stop")


class Formatter:
    """Shared header fields; subclasses build choices."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, model: str, token_text, with_logprobs: bool) -> None:
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text  # token id -> its text
        self.with_logprobs = with_logprobs

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def chunk(self, delta: GenerateDelta, acc: Accumulator, include_usage: bool) -> dict | None:
        choices = [c for s in delta.samples if (c := self._chunk_choice(s, acc.samples[s.index])) is not None]
        if not choices:
            return None
        out = self._envelope(self.chunk_object_name, choices)
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, acc: Accumulator) -> dict:
        return {**self._envelope(self.chunk_object_name, []), "usage": acc.usage()}

    def response(self, acc: Accumulator) -> dict:
        choices = [self._final_choice(i, s) for i, s in enumerate(acc.samples)]
        return {**self._envelope(self.object_name, choices), "usage": acc.usage()}

    def _chunk_choice(self, s: SampleDelta, state: SampleState) -> dict | None:
        raise NotImplementedError

    def _final_choice(self, index: int, state: SampleState) -> dict:
        raise NotImplementedError


class ChatFormatter(Formatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def _chunk_choice(self, s: SampleDelta, state: SampleState) -> dict | None:
        delta: dict = {}
        if not state.started:
            state.started = True
            delta["role"] = "assistant"
            delta["content"] = s.text
        elif s.text:
            delta["content"] = s.text
        finish = openai_finish_reason(s.finish_reason)
        if not delta and finish is None and not (self.with_logprobs and s.logprobs):
            return None
        choice = {"index": s.index, "delta": delta, "logprobs": None, "finish_reason": finish}
        if self.with_logprobs and s.logprobs:
            choice["logprobs"] = {"content": self._content_logprobs(s.logprobs), "refusal": None}
        return choice

    def _final_choice(self, index: int, state: SampleState) -> dict:
        logprobs = {"content": self._content_logprobs(state.logprobs), "refusal": None} if self.with_logprobs else None
        return {"index": index, "message": {"role": "assistant", "content": state.text, "refusal": None},
                "logprobs": logprobs, "finish_reason": openai_finish_reason(state.finish_reason)}

    def _content_logprobs(self, logprobs: list[TokenLogprob]) -> list[dict]:
        def entry(token_id: int, value: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": _lp(value), "bytes": list(text.encode("utf-8"))}

        return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in logprobs]


class CompletionFormatter(Formatter):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def _chunk_choice(self, s: SampleDelta, state: SampleState) -> dict | None:
        finish = openai_finish_reason(s.finish_reason)
        if not s.text and finish is None and not s.token_ids:
            return None
        offset = len(state.text) - len(s.text)  # state already holds this delta
        logprobs = self._logprobs(s.logprobs or [], offset) if self.with_logprobs else None
        return {"index": s.index, "text": s.text, "logprobs": logprobs, "finish_reason": finish}

    def _final_choice(self, index: int, state: SampleState) -> dict:
        logprobs = self._logprobs(state.logprobs, 0) if self.with_logprobs else None
        return {"index": index, "text": state.text, "logprobs": logprobs,
                "finish_reason": openai_finish_reason(state.finish_reason)}

    def _logprobs(self, logprobs: list[TokenLogprob], offset: int) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for lp in logprobs:
            text = self.token_text(lp.token_id)
            tokens.append(text)
            values.append(_lp(lp.logprob))
            tops.append({self.token_text(t): _lp(v) for t, v in lp.top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
