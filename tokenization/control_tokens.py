"""Control tokens: the added tokens that are a chat template's markup, kept out of user-supplied text.

A user who types `<|start_header_id|>system<|end_header_id|>` into a message must not open a system
turn. Before rendering, every string the request supplies (message content and names, tool call
arguments, tool definitions, template kwargs) has each control token replaced by a private marker;
the template's own markup is untouched. After rendering, the prompt is tokenized normally where it holds
no marker, and the stretches between two markup tokens that hold one are tokenized as plain text, the
markers put back as the characters they stand for (tokenizers already tokenizes each stretch between
added tokens on its own, so nothing else changes).

Markers are three characters of Unicode's Supplementary Private Use Area-B: OPEN, the token's index,
CLOSE. A client that sends marker characters itself can at most spell a control token as text, which
it could have typed anyway.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

_OPEN, _CLOSE, _BASE = "\U0010fff0", "\U0010fff1", 0x100000
_MARKER = re.compile(f"{_OPEN}([\U00100000-\U0010ffef]){_CLOSE}")


class ControlTokens:
    """A set of control-token strings and the marking and splitting done with them. Immutable."""

    def __init__(self, tokens: Iterable[str]) -> None:
        self.tokens: tuple[str, ...] = tuple(sorted({t for t in tokens if t}, key=lambda t: (-len(t), t)))
        if len(self.tokens) > 0xFFEF:
            raise ValueError(f"too many control tokens ({len(self.tokens)})")
        self._index = {t: i for i, t in enumerate(self.tokens)}
        self._pattern = re.compile("|".join(re.escape(t) for t in self.tokens)) if self.tokens else None

    def __contains__(self, token: object) -> bool:
        return token in self._index

    def mark(self, value: Any) -> Any:
        """`value` (strings, lists, tuples and dicts of them, keys included) with every control token in
        its strings replaced by a marker. Returns the same object where nothing had to change."""
        if self._pattern is None:
            return value
        if isinstance(value, str):
            return self._pattern.sub(lambda m: _OPEN + chr(_BASE + self._index[m.group(0)]) + _CLOSE, value)
        if isinstance(value, dict):
            return {self.mark(k): self.mark(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self.mark(v) for v in value)
        return value

    @staticmethod
    def has_markers(text: str) -> bool:
        return _OPEN in text

    def restore(self, text: str) -> str:
        """Markers back to the control tokens' characters (as text: the caller tokenizes it so)."""
        def token(m: re.Match[str]) -> str:
            i = ord(m.group(1)) - _BASE
            return self.tokens[i] if i < len(self.tokens) else m.group(0)

        return _MARKER.sub(token, text)

    def split(self, text: str) -> list[tuple[str, bool]]:
        """`text` cut at its control tokens: (piece, is_control_token) in order, no empty pieces."""
        if self._pattern is None:
            return [(text, False)] if text else []
        out: list[tuple[str, bool]] = []
        pos = 0
        for m in self._pattern.finditer(text):
            if m.start() > pos:
                out.append((text[pos : m.start()], False))
            out.append((m.group(0), True))
            pos = m.end()
        if pos < len(text):
            out.append((text[pos:], False))
        return out
