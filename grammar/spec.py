"""What a request asks its output to match: a JSON schema, any JSON object, a regex, or a choice list.

A `GrammarSpec` is the cache key of a compiled grammar, so its `value` is canonical: two schemas that
differ only in key order or whitespace give equal specs. Build specs with the class methods, which
validate and canonicalise; the constructor only checks the shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "tool_calls"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "tool_calls")

# The schema a json_object request compiles to: any JSON object, nothing else.
JSON_OBJECT_SCHEMA = '{"type":"object"}'


class GrammarError(ValueError):
    """A spec that cannot be compiled: invalid, unsupported by the backend, too large or too slow.

    The message names the offending keyword and its JSON pointer where there is one, e.g.
    "unsupported keyword 'uniqueItems' at #/properties/tags (backend llguidance ignores it)".
    `param` names the request field the refused part came from where the grammar knows it (a tool call
    grammar: "tools[2].function.parameters"); None leaves it to the caller.
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class BackendRefusal(GrammarError):
    """A backend's own refusal while compiling (not found by normalization): `detail` is its message.
    GrammarCompiler turns one for a JSON schema into a GrammarError that names the pointer it concerns
    (grammar/locate.py)."""

    def __init__(self, kind: str, backend: str, detail: str) -> None:
        super().__init__(f"{kind} refused by {backend}: {detail}")
        self.backend = backend
        self.detail = detail


def canonical_json(value: Any) -> str:
    """Sorted-keys, no-whitespace JSON text: equal values give equal strings."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint in canonical form.

    kind: "json_schema" (value: canonical JSON text of the schema), "json_object" (value: the
    any-object schema), "regex" (value: the pattern, matched against the whole output) or "choice"
    (value: canonical JSON list of the distinct options, sorted), "tool_calls" (value: canonical JSON of a
    grammar.tool_calls.ToolCallsSpec: format, tools, mode, answer schema).
    """

    kind: GrammarKind
    value: str

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; expected one of {GRAMMAR_KINDS}")
        if not isinstance(self.value, str) or not self.value:
            raise GrammarError(f"grammar {self.kind} needs a non-empty string value, got {self.value!r}")

    @classmethod
    def json_schema(cls, schema: dict | str) -> GrammarSpec:
        """A JSON schema given as a dict or as JSON text; the schema must be a JSON object."""
        if isinstance(schema, str | bytes):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"json_schema must be a JSON object, got {type(schema).__name__}")
        try:
            text = canonical_json(schema)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"json_schema is not serialisable as JSON: {e}") from None
        return cls("json_schema", text)

    @classmethod
    def json_object(cls) -> GrammarSpec:
        """Any JSON object (OpenAI's response_format={"type": "json_object"})."""
        return cls("json_object", JSON_OBJECT_SCHEMA)

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        """The whole output must match `pattern` (Rust `regex` syntax; no look-around, no backrefs)."""
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError(f"regex must be a non-empty string, got {pattern!r}")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str] | tuple[str, ...]) -> GrammarSpec:
        """The whole output is exactly one of `options`."""
        if isinstance(options, str) or not isinstance(options, list | tuple) or not options:
            raise GrammarError(f"choice needs a non-empty list of strings, got {options!r}")
        for option in options:
            if not isinstance(option, str) or not option:
                raise GrammarError(f"choice options must be non-empty strings, got {option!r}")
        return cls("choice", canonical_json(sorted(set(options))))

    @classmethod
    def tool_calls(cls, spec: dict) -> GrammarSpec:
        """Tool calls in a model's call format (`spec` is a ToolCallsSpec's JSON; grammar/tool_calls.py)."""
        try:
            return cls("tool_calls", canonical_json(spec))
        except (TypeError, ValueError) as e:
            raise GrammarError(f"tool_calls is not serialisable as JSON: {e}") from None

    def schema(self) -> dict:
        """The schema as a dict (json_schema and json_object kinds only)."""
        if self.kind not in ("json_schema", "json_object"):
            raise GrammarError(f"a {self.kind} grammar has no JSON schema")
        return json.loads(self.value)

    def choices(self) -> list[str]:
        """The options of a choice grammar, sorted."""
        if self.kind != "choice":
            raise GrammarError(f"a {self.kind} grammar has no choices")
        return json.loads(self.value)

    def as_regex(self) -> str:
        """Regex form of a regex or choice grammar (choices become an escaped alternation)."""
        if self.kind == "regex":
            return self.value
        if self.kind == "choice":
            return "(" + "|".join(escape_regex_literal(option) for option in self.choices()) + ")"
        raise GrammarError(f"a {self.kind} grammar has no regex form")


_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def escape_regex_literal(text: str) -> str:
    """Escape `text` so that a Rust-syntax regex matches it literally (Python's re.escape escapes
    spaces and other characters that Rust's parser rejects)."""
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)
