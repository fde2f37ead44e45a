"""Reads tool calls out of a model's text as it streams: content, then calls, in any split of the text.

`ToolCallParser(fmt).feed(text)` returns events for what became certain: `ContentDelta` (text that is
not part of a call), `CallStart` (a call's index and name, once), `ArgumentsDelta` (the next piece of
the call's arguments: its JSON text exactly as the model wrote it), and `finish()` the rest. Text that
could still be the start of a trigger ("<tool" before "<tool_call>") and trailing whitespace are held
back, so content never shows a trigger or half a call. `parse_tool_calls` runs the same machine over a
whole text, so a streamed answer assembled piece by piece equals the non-streamed one.

What follows a trigger but turns out not to be a call (no name, not an object) goes back to content as
it was written; a call cut short (max_tokens) keeps the arguments it got, as OpenAI's do, and one cut
before its name is dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tokenization.tool_formats import ToolCallFormat

_WS = " \t\r\n"


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


Event = ContentDelta | CallStart | ArgumentsDelta


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass
class ParsedOutput:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


def parse_tool_calls(fmt: ToolCallFormat, text: str) -> ParsedOutput:
    """The content and calls of a whole output (the streaming machine, fed at once)."""
    parser = ToolCallParser(fmt)
    return assemble([*parser.feed(text), *parser.finish()])


def assemble(events: list[Event]) -> ParsedOutput:
    """Events → content and calls, the way a client puts streamed deltas together."""
    out = ParsedOutput("")
    for e in events:
        if isinstance(e, ContentDelta):
            out.content += e.text
        elif isinstance(e, CallStart):
            out.calls.append(ParsedCall(e.name, ""))
        else:
            out.calls[e.index].arguments += e.text
    return out


# What a character did to a call object: consumed; closed it (consumed); ended a started call (not
# consumed: it belongs to what follows); cannot be part of a call, which never started (not consumed).
_OK, _DONE, _BROKE, _FAIL = "ok", "done", "broke", "fail"


class _CallObject:
    """One call's JSON object, a character at a time: {"name": "...", "<arguments|parameters>": {...}}.

    Emits CallStart once the name is known and the arguments begin (arguments written before the name
    are held until it comes), then the arguments' characters. `step` returns one of _OK, _DONE, _BROKE
    and _FAIL (see above).
    """

    ARGUMENT_KEYS = ("arguments", "parameters")

    def __init__(self, index: int, events: list[Event]) -> None:
        self.index = index
        self.events = events
        self.state = "start"
        self.name: str | None = None
        self.started = False  # CallStart emitted
        self.raw = ""  # a string being read (key, name, string-valued arguments), escapes included
        self.escape = False
        self.key = ""
        self.held_args = ""  # arguments seen before the name
        self.args_seen = False
        self.depth = 0
        self.in_string = False

    def _args(self, text: str) -> None:
        if self.started:
            self.events.append(ArgumentsDelta(self.index, text))
        else:
            self.held_args += text

    def _start(self) -> None:
        if not self.started and self.name is not None:
            self.started = True
            self.events.append(CallStart(self.index, self.name))
            if self.held_args:
                self.events.append(ArgumentsDelta(self.index, self.held_args))
                self.held_args = ""

    def _string(self, c: str) -> bool:
        """Read one character of a JSON string into `raw`; True when the closing quote came."""
        if self.escape:
            self.escape = False
        elif c == "\\":
            self.escape = True
        elif c == '"':
            return True
        self.raw += c
        return False

    def close(self) -> None:
        """The text ended inside the object: a named call keeps what it got."""
        if self.name is not None:
            self._start()

    def step(self, c: str) -> str:
        s = self.state
        if s in ("start", "key_or_end", "key_start", "colon", "value", "after_value") and c in _WS:
            return _OK
        if s == "start":
            if c != "{":
                return _FAIL
            self.state = "key_or_end"
        elif s in ("key_or_end", "key_start"):
            if c == "}" and s == "key_or_end":
                return self._end()
            if c != '"':
                return self._fail()
            self.state, self.raw = "key", ""
        elif s == "key":
            if self._string(c):
                self.key, self.state = _decode(self.raw), "colon"
        elif s == "colon":
            if c != ":":
                return self._fail()
            self.state = "value"
        elif s == "value":
            return self._value(c)
        elif s == "name":
            if self._string(c):
                self.name, self.state = _decode(self.raw), "after_value"
                if self.args_seen:
                    self._start()
        elif s == "args":
            self._args(c)
            self._track(c)
            if self.depth == 0:
                self.state = "after_value"
        elif s == "args_string":
            if self._string(c):
                self._args(_decode(self.raw))
                self.state = "after_value"
        elif s == "skip":
            return self._skip(c)
        elif s == "after_value":
            if c == ",":
                self.state = "key_start"
            elif c == "}":
                return self._end()
            else:
                return self._fail()
        return _OK

    def _value(self, c: str) -> str:
        if self.key == "name":
            if c != '"':
                return self._fail()
            self.state, self.raw = "name", ""
        elif self.key in self.ARGUMENT_KEYS and not self.args_seen:
            self.args_seen = True
            self._start()
            if c == "{":
                self.state, self.depth, self.in_string = "args", 0, False
                self._args(c)
                self._track(c)
            elif c == '"':
                self.state, self.raw = "args_string", ""
            else:
                return self._fail()
        else:
            self.state, self.depth, self.in_string, self.raw = "skip", 0, False, ""
            return self._skip(c)
        return _OK

    def _skip(self, c: str) -> str:
        """Another key's value, passed over (a string, an object or array, or a scalar)."""
        if self.depth == 0 and not self.in_string and self.raw and c in ",}" + _WS:
            self.state = "after_value"
            return self.step(c)
        self.raw += c
        self._track(c)
        return _OK

    def _track(self, c: str) -> None:
        """Nesting depth and string state inside a JSON value."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
        elif c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1

    def _end(self) -> str:
        if self.name is None:
            return _FAIL
        if not self.started:
            self._start()
        if not self.args_seen:
            self.events.append(ArgumentsDelta(self.index, "{}"))
        return _DONE

    def _fail(self) -> str:
        return _BROKE if self.started else _FAIL


def _decode(raw: str) -> str:
    try:
        return json.loads('"' + raw + '"')
    except ValueError:
        return raw


class ToolCallParser:
    """Incremental tool-call reader for one sample. Not thread-safe; one per sample."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.buf = ""
        self.pos = 0
        self.mode = "content"
        self.at_start = fmt.calls_at_start  # the answer may still open with a call's "{"
        self.atoms: tuple[str, ...] = ()  # ATOMS mode: what must come before the call
        self.section_start = 0  # where the text a failed call gives back to content begins
        self.call: _CallObject | None = None
        self.num_calls = 0
        self.events: list[Event] = []
        self.after: tuple[list[tuple[str, ...]], int] = ([], 0)  # AFTER mode: (candidates, atoms matched)

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        """The text ended. A call cut short keeps what it got once named; one cut before its name, or a
        trigger with nothing after it, is dropped: it is half a call, not content."""
        self._run(final=True)
        if self.mode == "call" and self.call is not None:
            self.call.close()
        if self.mode == "content" and self.pos < len(self.buf):
            self.events.append(ContentDelta(self.buf[self.pos :]))
        self.buf, self.pos, self.mode = "", 0, "content"
        return self._take()

    def _take(self) -> list[Event]:
        # text from `section_start` on may still go back to content, until a call has started
        committed = self.mode == "content" or (self.call is not None and self.call.started)
        keep = self.pos if committed else self.section_start
        self.buf, self.pos, self.section_start = self.buf[keep:], self.pos - keep, self.section_start - keep
        events = _coalesce(self.events)
        self.events.clear()  # NOTE: in place: the call object appends to this same list
        return events

    def _run(self, final: bool) -> None:
        while True:
            before = (self.mode, self.pos)
            if self.mode == "content":
                self._content(final)
            elif self.mode == "atoms":
                self._atoms(final)
            elif self.mode == "call":
                self._call()
            else:
                self._after(final)
            if (self.mode, self.pos) == before:
                return

    # ----- modes ------------------------------------------------------------------------------------

    def _content(self, final: bool) -> None:
        buf, fmt = self.buf, self.fmt
        if self.at_start:
            i = self.pos
            while i < len(buf) and buf[i] in _WS:
                i += 1
            if i == len(buf):
                return  # only whitespace so far: undecided
            self.at_start = False
            if buf[i] == "{":
                self._open_call(self.pos, i, ())
                return
        found = buf.find(fmt.trigger, self.pos)
        if found >= 0:
            self._emit_content(buf[self.pos : found].rstrip(_WS))
            self._open_call(found, found + len(fmt.trigger), fmt.open_atoms[1:])
            return
        end = len(buf) if final else len(buf) - _partial_suffix(buf, self.pos, fmt.trigger)
        safe = end if final else len(buf[self.pos : end].rstrip(_WS)) + self.pos
        if safe > self.pos:
            self._emit_content(buf[self.pos : safe])
            self.pos = safe

    def _open_call(self, section_start: int, pos: int, atoms: tuple[str, ...]) -> None:
        self.section_start, self.pos = section_start, pos
        self.atoms = atoms
        self.mode = "atoms" if atoms else "call"
        if not atoms:
            self.call = _CallObject(self.num_calls, self.events)

    def _atoms(self, final: bool) -> None:
        i = self._skip_ws(self.pos)
        rest = self.buf[i:]
        atom = self.atoms[0]
        if rest.startswith(atom):
            self.pos, self.atoms = i + len(atom), self.atoms[1:]
            if not self.atoms:
                self.mode, self.call = "call", _CallObject(self.num_calls, self.events)
        elif atom.startswith(rest):
            return  # more may come; at the end, finish drops it
        else:
            self._give_back()

    def _call(self) -> None:
        assert self.call is not None
        while self.pos < len(self.buf):
            status = self.call.step(self.buf[self.pos])
            if status == _FAIL:
                self._give_back()
                return
            if status in (_DONE, _BROKE):
                if status == _DONE:
                    self.pos += 1
                self.num_calls += 1
                self.call, self.mode = None, "after"
                self.after = ([self.fmt.separator_atoms, self.fmt.close_atoms], 0)
                self.section_start = self.pos
                return
            self.pos += 1

    def _after(self, final: bool) -> None:
        candidates, k = self.after
        i = self._skip_ws(self.pos)
        rest = self.buf[i:]
        sep, close = self.fmt.separator_atoms, self.fmt.close_atoms
        if sep in candidates and k == len(sep):
            self.pos = i
            self.mode, self.call = "call", _CallObject(self.num_calls, self.events)
            return
        pending = [c for c in candidates if k < len(c)]
        for c in pending:
            if rest.startswith(c[k]):
                self.pos = i + len(c[k])
                self.after = ([d for d in candidates if k < len(d) and d[k] == c[k]], k + 1)
                return
        if not final and any(c[k].startswith(rest) for c in pending):
            return
        # neither another call nor more of the closing text: the section is over
        self.mode, self.at_start = "content", False
        if close in candidates and k == len(close):
            self.pos = i

    # ----- helpers ----------------------------------------------------------------------------------

    def _skip_ws(self, i: int) -> int:
        while i < len(self.buf) and self.buf[i] in _WS:
            i += 1
        return i

    def _give_back(self) -> None:
        """What followed the trigger is not a call: it is content, as written."""
        self._emit_content(self.buf[self.section_start : self.pos])
        self.mode, self.call, self.at_start = "content", None, False
        if self.pos == self.section_start:  # nothing consumed: step past the trigger's first character
            self._emit_content(self.buf[self.pos : self.pos + 1])
            self.pos += 1

    def _emit_content(self, text: str) -> None:
        if text:
            self.events.append(ContentDelta(text))


def _partial_suffix(buf: str, start: int, trigger: str) -> int:
    """The length of the longest end of buf[start:] that is a proper prefix of `trigger`."""
    for n in range(min(len(trigger) - 1, len(buf) - start), 0, -1):
        if buf.endswith(trigger[:n]):
            return n
    return 0


def _coalesce(events: list[Event]) -> list[Event]:
    out: list[Event] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, ContentDelta) and isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + e.text)
        elif isinstance(e, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == e.index:
            out[-1] = ArgumentsDelta(e.index, last.text + e.text)
        else:
            out.append(e)
    return out
