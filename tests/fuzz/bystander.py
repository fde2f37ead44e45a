"""A bystander tenant that streams the same greedy completion over and over from a background thread.

`reference()` is its stream in a quiet run; `running()` streams until the block ends and records every
stream's tokens. A stream that ended early, errored or produced other tokens is a casualty of whatever the
attacker did meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

from tests.gateway.conftest import BASE_MODEL

PROMPT_TOKEN_IDS = [300 + 7 * i for i in range(24)]  # fixed: every stream asks for the same thing
MAX_TOKENS = 24


@dataclass(frozen=True)
class Stream:
    """One streamed completion as the bystander saw it."""

    status: int
    tokens: tuple[str, ...]  # the logprobs' token strings, in order
    text: str
    finish_reason: str | None
    done: bool  # `data: [DONE]` arrived


@dataclass
class Bystander:
    url: str
    key: str
    streams: list[Stream] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # exceptions the thread met (transport errors)

    def stream_once(self) -> Stream:
        body = {"model": BASE_MODEL, "prompt": PROMPT_TOKEN_IDS, "max_tokens": MAX_TOKENS, "temperature": 0,
                "stream": True, "logprobs": 0}
        tokens: list[str] = []
        text, finish, done = "", None, False
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120,
                          headers={"authorization": f"Bearer {self.key}"}) as resp:
            if resp.status_code != 200:
                resp.read()
                return Stream(resp.status_code, (), resp.text, None, False)
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[len("data: "):])
                for choice in chunk["choices"]:
                    text += choice["text"]
                    tokens += (choice.get("logprobs") or {}).get("tokens", [])
                    finish = choice["finish_reason"] or finish
        return Stream(200, tuple(tokens), text, finish, done)

    def reference(self) -> Stream:
        stream = self.stream_once()
        assert stream.status == 200 and stream.done and stream.finish_reason == "length", stream
        assert len(stream.tokens) == MAX_TOKENS, stream
        return stream

    @contextlib.contextmanager
    def running(self) -> Iterator[Bystander]:
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                try:
                    self.streams.append(self.stream_once())
                except Exception as e:  # noqa: BLE001 - recorded, and the test fails on it
                    self.failures.append(f"{type(e).__name__}: {e}")

        thread = threading.Thread(target=loop, name="bystander", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join(timeout=180)

    def casualties(self, reference: Stream) -> list[Stream]:
        return [s for s in self.streams if s != reference]
