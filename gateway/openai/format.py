"""Engine deltas → OpenAI response objects: chat.completion(.chunk) and text_completion.

A `Formatter` knows one endpoint's shapes. A streamed answer keeps only counters per sample
(`StreamCounters`: tokens, characters, finish reason), so each chunk costs the same at any position; a
non-streamed answer (`Collected`) also keeps each sample's text pieces and logprobs, because its caller
asks for the whole. Logprobs use the tokenizer to name tokens; -inf becomes -9999.0 as in OpenAI's API
(JSON has no infinity).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from wire.protocol import GenerateDelta, Logprob, SampleDelta

MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return MIN_LOGPROB if not math.isfinite(value) else max(value, MIN_LOGPROB)


@dataclass
class SampleCounters:
    num_tokens: int = 0
    num_chars: int = 0  # characters of text sent so far (the completions API's text_offset)
    finish_reason: str | None = None
    started: bool = False  # the first (role) chunk went out


class StreamCounters:
    """What a streamed answer keeps per request: O(1) per delta, nothing that grows with the output."""

    def __init__(self, n: int) -> None:
        self.samples = [SampleCounters() for _ in range(n)]
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def add(self, delta: GenerateDelta) -> None:
        self.prompt_tokens = delta.num_prompt_tokens
        self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens)
        for s in delta.samples:
            counters = self.samples[s.index]
            counters.num_tokens += len(s.token_ids)
            counters.num_chars += len(s.text)
            counters.finish_reason = s.finish_reason or counters.finish_reason

    @property
    def completion_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class Collected(StreamCounters):
    """A non-streamed answer: the counters plus every sample's text pieces and logprobs."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.pieces: list[list[str]] = [[] for _ in range(n)]
        self.logprobs: list[list[Logprob]] = [[] for _ in range(n)]

    def add(self, delta: GenerateDelta) -> None:
        super().add(delta)
        for s in delta.samples:
            if s.text:
                self.pieces[s.index].append(s.text)
            if s.logprobs:
                self.logprobs[s.index].extend(s.logprobs)

    def text(self, index: int) -> str:
        return "".join(self.pieces[index])


def openai_finish_reason(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length"}.get(reason or "", None if reason is None else "stop")


class Formatter:
    """Shared header fields; subclasses build choices."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, model: str, token_text: Callable[[int], str], with_logprobs: bool) -> None:
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text  # token id -> its text
        self.with_logprobs = with_logprobs

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def chunk(self, delta: GenerateDelta, counters: StreamCounters, include_usage: bool) -> dict | None:
        """The chunk for `delta`, which `counters` already holds (None when it carries nothing to send)."""
        choices = [c for s in delta.samples if (c := self._chunk_choice(s, counters.samples[s.index])) is not None]
        if not choices:
            return None
        out = self._envelope(self.chunk_object_name, choices)
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, counters: StreamCounters) -> dict:
        return {**self._envelope(self.chunk_object_name, []), "usage": counters.usage()}

    def response(self, collected: Collected) -> dict:
        choices = [self._final_choice(i, collected) for i in range(len(collected.samples))]
        return {**self._envelope(self.object_name, choices), "usage": collected.usage()}

    def _chunk_choice(self, s: SampleDelta, counters: SampleCounters) -> dict | None:
        raise NotImplementedError

    def _final_choice(self, index: int, collected: Collected) -> dict:
        raise NotImplementedError


class ChatFormatter(Formatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def _chunk_choice(self, s: SampleDelta, counters: SampleCounters) -> dict | None:
        delta: dict = {}
        if not counters.started:
            counters.started = True
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

    def _final_choice(self, index: int, collected: Collected) -> dict:
        logprobs = None
        if self.with_logprobs:
            logprobs = {"content": self._content_logprobs(collected.logprobs[index]), "refusal": None}
        return {"index": index, "message": {"role": "assistant", "content": collected.text(index), "refusal": None},
                "logprobs": logprobs, "finish_reason": openai_finish_reason(collected.samples[index].finish_reason)}

    def _content_logprobs(self, logprobs: list[Logprob]) -> list[dict]:
        def entry(token_id: int, value: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": _lp(value), "bytes": list(text.encode("utf-8"))}

        return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in logprobs]


class CompletionFormatter(Formatter):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def _chunk_choice(self, s: SampleDelta, counters: SampleCounters) -> dict | None:
        finish = openai_finish_reason(s.finish_reason)
        if not s.text and finish is None and not s.token_ids:
            return None
        offset = counters.num_chars - len(s.text)  # the counters already hold this delta
        logprobs = self._logprobs(s.logprobs or [], offset) if self.with_logprobs else None
        return {"index": s.index, "text": s.text, "logprobs": logprobs, "finish_reason": finish}

    def _final_choice(self, index: int, collected: Collected) -> dict:
        logprobs = self._logprobs(collected.logprobs[index], 0) if self.with_logprobs else None
        return {"index": index, "text": collected.text(index), "logprobs": logprobs,
                "finish_reason": openai_finish_reason(collected.samples[index].finish_reason)}

    def _logprobs(self, logprobs: list[Logprob], offset: int) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for lp in logprobs:
            text = self.token_text(lp.token_id)
            tokens.append(text)
            values.append(_lp(lp.logprob))
            tops.append({self.token_text(t): _lp(v) for t, v in lp.top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
