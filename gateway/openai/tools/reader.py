"""One sample's text → OpenAI's `content` and `tool_calls`, streamed as OpenAI sends them or whole.

Streamed, each call's first fragment carries its `index`, `id` (call_...), `type` and `function.name`
(once: the openai client concatenates repeated strings), then fragments carry `index` and the next
piece of `function.arguments`. Content is what the parser (tokenization/tool_parser.py) gives back as
content: never a trigger or half a call. A tool request decodes with special tokens kept (its markers
may be special tokens), so the token that ended the sample is cut from its last text here.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from tokenization.tool_formats import ToolCallFormat
from tokenization.tool_parser import ArgumentsDelta, CallStart, ContentDelta, Event, ToolCallParser


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class ToolCallReader:
    """Reads one sample. `add` for each delta's text, `finish` with the last one; both return
    (content text, tool_calls fragments). `calls` holds the calls whole as they complete."""

    def __init__(self, fmt: ToolCallFormat, new_id: Callable[[], str] = new_call_id) -> None:
        self.parser = ToolCallParser(fmt)
        self.new_id = new_id
        self.calls: list[dict[str, Any]] = []
        self.content = ""

    def add(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        return self._convert(self.parser.feed(text))

    def finish(self, text: str, stop_text: str | None = None) -> tuple[str, list[dict[str, Any]]]:
        """The sample's last text; `stop_text` is the text of the token that ended it, cut if it ends the text."""
        if stop_text and text.endswith(stop_text):
            text = text[: -len(stop_text)]
        return self._convert([*self.parser.feed(text), *self.parser.finish()])

    def _convert(self, events: list[Event]) -> tuple[str, list[dict[str, Any]]]:
        content = ""
        fragments: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, ContentDelta):
                content += e.text
            elif isinstance(e, CallStart):
                call = {"id": self.new_id(), "type": "function", "function": {"name": e.name, "arguments": ""}}
                self.calls.append(call)
                fragments.append({"index": e.index, "id": call["id"], "type": "function",
                                  "function": {"name": e.name, "arguments": ""}})
            elif isinstance(e, ArgumentsDelta):
                self.calls[e.index]["function"]["arguments"] += e.text
                last = fragments[-1] if fragments else None
                if last is not None and last["index"] == e.index:
                    last["function"]["arguments"] += e.text
                else:
                    fragments.append({"index": e.index, "function": {"arguments": e.text}})
        self.content += content
        return content, fragments
