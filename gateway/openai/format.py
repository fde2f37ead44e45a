"""Engine deltas → OpenAI response objects: chat.completion(.chunk) and text_completion.

A `Formatter` knows one endpoint's shapes. A streamed answer keeps only counters per sample
(`StreamCounters`: tokens, characters, finish reason), so each chunk costs the same at any position; a
non-streamed answer (`Collected`) also keeps each sample's text pieces and logprobs, because its caller
asks for the whole. Every choice carries `stop_reason` as vLLM's do: the stop string or stop token id that
ended the sample, null while it runs and when it ended by EOS, its grammar or its length. Logprobs use the
tokenizer to name tokens; -inf becomes -9999.0 as in OpenAI's API (JSON has no infinity).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.openai.tools.reader import ToolCallReader
from tokenization.tool_formats import ToolCallFormat
from wire.protocol import GenerateDelta, Logprob, SampleDelta

MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return MIN_LOGPROB if not math.isfinite(value) else max(value, MIN_LOGPROB)


@dataclass
class SampleCounters:
    num_tokens: int = 0
    num_chars: int = 0  # characters of text sent so far (the completions API's text_offset)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended the sample
    started: bool = False  # the first (role) chunk went out
    last_token_id: int | None = None  # the sample's latest token (a tool request cuts a final special one)
    answered_finish: str | None = None  # the finish_reason the answer gave the client ("tool_calls", ...)


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
            if s.finish_reason is not None:
                counters.stop_reason = _stop_reason(s)
            if s.token_ids:
                counters.last_token_id = s.token_ids[-1]

    @property
    def completion_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    @property
    def finish_reasons(self) -> tuple[str | None, ...]:
        """Each choice's finish_reason as answered; None for a choice the answer did not finish."""
        return tuple(s.answered_finish for s in self.samples)

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


def _stop_reason(s: SampleDelta) -> int | str | None:
    """A streamed choice's stop_reason: only its finishing delta names one (an abort's reason is not a stop)."""
    return s.stop_reason if s.finish_reason == "stop" else None


def openai_finish_reason(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length"}.get(reason or "", None if reason is None else "stop")


class Formatter:
    """Shared header fields; subclasses build choices."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, model: str, token_text: Callable[[int], str], with_logprobs: bool,
                 service_tier: str | None = None) -> None:
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text  # token id -> its text
        self.with_logprobs = with_logprobs
        self.service_tier = service_tier  # reported back when the request chose one

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        out = {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
               "system_fingerprint": None, "choices": choices}
        if self.service_tier is not None:
            out["service_tier"] = self.service_tier
        return out

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
    """Chat shapes. With `tools` (the served model's call format, for a request whose tool_choice allows
    calls) each sample's text is read into content and tool_calls (gateway/openai/tools/reader.py), the
    final special token of the sample cut (`special_token_ids`), and a sample that made calls finishes
    with "tool_calls"."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, response_id: str, model: str, token_text: Callable[[int], str], with_logprobs: bool,
                 service_tier: str | None = None, tools: ToolCallFormat | None = None,
                 special_token_ids: frozenset[int] = frozenset()) -> None:
        super().__init__(response_id, model, token_text, with_logprobs, service_tier)
        self.tools = tools
        self.special_token_ids = special_token_ids
        self._readers: dict[int, ToolCallReader] = {}  # streamed samples' readers, by index

    def _stop_text(self, token_id: int | None) -> str | None:
        return self.token_text(token_id) if token_id is not None and token_id in self.special_token_ids else None

    def _read(self, s: SampleDelta, counters: SampleCounters) -> tuple[str, list[dict], bool]:
        """(content, tool_calls fragments, made calls) of a streamed delta."""
        if self.tools is None:
            return s.text, [], False
        reader = self._readers.setdefault(s.index, ToolCallReader(self.tools))
        if s.finish_reason is None:
            content, fragments = reader.add(s.text)
        else:
            content, fragments = reader.finish(s.text, self._stop_text(counters.last_token_id))
        return content, fragments, bool(reader.calls)

    def _chunk_choice(self, s: SampleDelta, counters: SampleCounters) -> dict | None:
        text, fragments, called = self._read(s, counters)
        delta: dict = {}
        if not counters.started:
            counters.started = True
            delta["role"] = "assistant"
            delta["content"] = text
        elif text:
            delta["content"] = text
        if fragments:
            delta["tool_calls"] = fragments
        finish = openai_finish_reason(s.finish_reason)
        if finish == "stop" and called:
            finish = "tool_calls"
        counters.answered_finish = finish or counters.answered_finish
        if not delta and finish is None and not (self.with_logprobs and s.logprobs):
            return None
        choice = {"index": s.index, "delta": delta, "logprobs": None, "finish_reason": finish,
                  "stop_reason": _stop_reason(s)}
        if self.with_logprobs and s.logprobs:
            choice["logprobs"] = {"content": self._content_logprobs(s.logprobs), "refusal": None}
        return choice

    def _final_choice(self, index: int, collected: Collected) -> dict:
        logprobs = None
        if self.with_logprobs:
            logprobs = {"content": self._content_logprobs(collected.logprobs[index]), "refusal": None}
        sample = collected.samples[index]
        message: dict = {"role": "assistant", "content": collected.text(index), "refusal": None}
        finish = openai_finish_reason(sample.finish_reason)
        if self.tools is not None:
            reader = ToolCallReader(self.tools)
            content, _ = reader.finish(collected.text(index), self._stop_text(sample.last_token_id))
            message["content"] = content if content or not reader.calls else None
            if reader.calls:
                message["tool_calls"] = reader.calls
                finish = "tool_calls" if finish == "stop" else finish
        sample.answered_finish = finish
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": sample.stop_reason}

    def _content_logprobs(self, logprobs: list[Logprob]) -> list[dict]:
        def entry(token_id: int, value: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": _lp(value), "bytes": list(text.encode("utf-8"))}

        return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in logprobs]


class CompletionFormatter(Formatter):
    """Completions shapes. `echo`: each prompt's text, put before its choices' text (choice i * n + j is
    prompt i's sample j)."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, response_id: str, model: str, token_text: Callable[[int], str], with_logprobs: bool,
                 echo: list[str] | None = None, n: int = 1) -> None:
        super().__init__(response_id, model, token_text, with_logprobs)
        self.echo = echo
        self.n = n

    def _echo(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo is not None else ""

    def _chunk_choice(self, s: SampleDelta, counters: SampleCounters) -> dict | None:
        finish = openai_finish_reason(s.finish_reason)
        counters.answered_finish = finish or counters.answered_finish
        text = s.text
        if not counters.started:
            counters.started = True
            text = self._echo(s.index) + text
        if not text and finish is None and not s.token_ids:
            return None
        offset = counters.num_chars - len(s.text)  # the counters already hold this delta
        logprobs = self._logprobs(s.logprobs or [], offset) if self.with_logprobs else None
        return {"index": s.index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": _stop_reason(s)}

    def _final_choice(self, index: int, collected: Collected) -> dict:
        logprobs = self._logprobs(collected.logprobs[index], 0) if self.with_logprobs else None
        finish = collected.samples[index].answered_finish = openai_finish_reason(collected.samples[index].finish_reason)
        return {"index": index, "text": self._echo(index) + collected.text(index), "logprobs": logprobs,
                "finish_reason": finish, "stop_reason": collected.samples[index].stop_reason}

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
