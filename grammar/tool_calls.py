"""The grammar of a request's tool calls: a Lark grammar (llguidance's dialect) from the call format.

What it allows, by `ToolCallSpec.mode`:
- "required" (also a named tool_choice: one tool listed): calls only, from the first token — the
  format's opening text, then one call (`parallel=False`) or calls joined by its separator, then its
  closing text, then EOS. Each call is `{"name": "<one of the tools>", "<arguments key>": ` + that
  tool's parameters as an embedded JSON schema (`%json`) + `}`.
- "auto": free text, or the answer schema of response_format when there is one, until the model opens
  a call with the format's trigger; then the calls as above. The free text cannot hold the trigger (a
  special token is never text; a textual trigger is excluded from it), so once written the call is
  constrained. Formats whose calls may open the answer (Llama's bare JSON) allow that too, and free text
  then may not begin with "{".

Markers that are special tokens of the vocabulary (`<|python_tag|>`, `[TOOL_CALLS]`) are written as
token ids (`<[id]>`), the rest as literal text. JSON inside calls is written as the family's templates
render it (`tojson`: ", " and ": "), without other free whitespace.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jsonschema

from grammar.guard import OutputGuard, schema_validator
from grammar.spec import GrammarError, GrammarSpec, escape_regex_literal
from tokenization.tool_formats import ToolCallFormat, tool_format
from tokenization.tool_parser import parse_tool_calls

if TYPE_CHECKING:
    from grammar.normalize import NormalizedSchema, NormalizeReport

# How call JSON is written: like json.dumps, the way chat templates render calls (`tojson`).
CALL_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                     "lenient": False, "coerce_one_of": False}
ANSWER_JSON_OPTIONS = {"whitespace_flexible": False, "lenient": False, "coerce_one_of": False}


@dataclass(frozen=True)
class ToolGrammarInput:
    """What the grammar is built from: the format, the tools' (name, normalized parameters schema), the
    mode, whether calls may repeat, the answer schema for auto mode (response_format), and the ids of
    the vocabulary's special tokens by their text."""

    format: ToolCallFormat
    tools: Sequence[tuple[str, dict]]
    mode: str  # "auto" | "required"
    parallel: bool
    special_ids: Mapping[str, int]
    answer_schema: dict | None = None


@dataclass(frozen=True)
class ToolEntry:
    """One tool a call may name: its index among the request's tools (for error params), name, schema."""

    index: int
    name: str
    schema: dict


@dataclass(frozen=True)
class ToolCallsSpec:
    """The tool_calls grammar a request asks for (the value of a "tool_calls" GrammarSpec, decoded)."""

    format: str
    tools: tuple[ToolEntry, ...]
    mode: str
    parallel: bool
    answer_schema: dict | None
    special_ids: Mapping[str, int]

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "tools": [[t.index, t.name, t.schema] for t in self.tools], "mode": self.mode,
                "parallel": self.parallel, "answer": self.answer_schema, "special_ids": dict(self.special_ids)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ToolCallsSpec:
        """Raises GrammarError for a value that is not a tool_calls spec."""
        try:
            tools = tuple(ToolEntry(int(i), str(name), dict(schema)) for i, name, schema in data["tools"])
            spec = cls(str(data["format"]), tools, str(data["mode"]), bool(data["parallel"]), data.get("answer"),
                       {str(k): int(v) for k, v in data.get("special_ids", {}).items()})
            tool_format(spec.format)
        except (KeyError, TypeError, ValueError) as e:
            raise GrammarError(f"not a tool_calls grammar: {e}") from None
        if not tools or spec.mode not in ("auto", "required"):
            raise GrammarError("a tool_calls grammar needs tools and a mode of auto or required")
        return spec

    def grammar_input(self, schemas: Sequence[dict], answer: dict | None) -> ToolGrammarInput:
        """The grammar's input with the tools' normalized `schemas` (in order) and normalized answer."""
        return ToolGrammarInput(tool_format(self.format), [(t.name, s) for t, s in zip(self.tools, schemas, strict=True)],
                                self.mode, self.parallel, self.special_ids, answer)


def normalize_tool_calls(spec: ToolCallsSpec, normalize: Callable[[dict], NormalizedSchema]) -> NormalizedSchema:
    """Every tool's parameters (and the answer schema) through `normalize`: the strictness of
    response_format. Raises GrammarError whose `param` (and message start) names the refused schema.
    Returns {"tools": [normalized schema per tool], "answer": normalized answer or None} and the merged
    report."""
    from grammar.normalize import NormalizedSchema, NormalizeReport

    report = NormalizeReport()
    schemas = []
    for tool in spec.tools:
        try:
            done = normalize(tool.schema)
        except GrammarError as e:
            param = f"tools[{tool.index}].function.parameters"
            raise GrammarError(f"{param}: {e}", param=param) from None
        schemas.append(done.schema)
        _merge(report, done.report)
    answer = None
    if spec.answer_schema is not None and spec.mode == "auto":
        try:
            done = normalize(spec.answer_schema)
        except GrammarError as e:
            raise GrammarError(f"response_format: {e}", param="response_format") from None
        answer = done.schema
        _merge(report, done.report)
    return NormalizedSchema({"tools": schemas, "answer": answer}, report)


def _merge(into: NormalizeReport, report: NormalizeReport) -> None:
    into.ignored_formats.update(report.ignored_formats)
    into.approximations.update(report.approximations)
    into.rewrites.update(report.rewrites)


def tool_calls_lark(spec: GrammarSpec, normalized: dict | None) -> str:
    """The Lark grammar of a "tool_calls" spec, with its schemas as normalized (`normalized`, from
    normalize_tool_calls) or as given."""
    calls = ToolCallsSpec.from_json(json.loads(spec.value))
    if normalized is None:
        normalized = {"tools": [t.schema for t in calls.tools], "answer": calls.answer_schema}
    answer = normalized["answer"] if calls.mode == "auto" else None
    return tool_call_lark(calls.grammar_input(normalized["tools"], answer))


class ToolCallGuard(OutputGuard):
    """Validates finished tool-call outputs: the text parses into calls (the format's parser), each names
    an allowed tool, its arguments validate against that tool's own schema (python-jsonschema, the
    schema as the request sent it), calls are at least one in required mode and exactly one without
    parallel calls; an auto answer without calls validates against the answer schema if there is one."""

    def __init__(self, spec: GrammarSpec) -> None:
        super().__init__(spec)
        self.calls = ToolCallsSpec.from_json(json.loads(spec.value))
        self.format = tool_format(self.calls.format)
        self._validators = {t.name: schema_validator(t.schema) for t in self.calls.tools}
        answer = self.calls.answer_schema if self.calls.mode == "auto" else None
        self._answer = schema_validator(answer) if answer is not None else None

    def check(self, text: str) -> str | None:
        parsed = parse_tool_calls(self.format, text)
        if not parsed.calls:
            if self.calls.mode == "required":
                return "the output holds no tool call"
            return _validate(self._answer, parsed.content, "the answer") if self._answer else None
        if not self.calls.parallel and len(parsed.calls) != 1:
            return f"the output holds {len(parsed.calls)} calls, one was allowed"
        for i, call in enumerate(parsed.calls):
            validator = self._validators.get(call.name)
            if validator is None:
                return f"call {i} names a tool that was not allowed"
            problem = _validate(validator, call.arguments, f"call {i}'s arguments")
            if problem:
                return problem
        return None


def _validate(validator: Any, text: str, what: str) -> str | None:
    try:
        instance = json.loads(text)
    except (ValueError, RecursionError) as e:
        return f"{what} are not valid JSON ({type(e).__name__})"
    try:
        error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    except RecursionError:
        return f"{what} nest too deeply to validate"
    if error is None:
        return None
    path = "/".join(str(p) for p in error.absolute_path)
    return f"{what} fail the schema at /{path}: keyword {error.validator!r}"


def tool_call_lark(spec: ToolGrammarInput) -> str:
    """The Lark grammar text for `spec`. Raises ValueError for an empty tool list or an unknown mode."""
    if not spec.tools:
        raise ValueError("a tool call grammar needs at least one tool")
    if spec.mode not in ("auto", "required"):
        raise ValueError(f"unknown tool call mode {spec.mode!r}")
    fmt, ids = spec.format, spec.special_ids
    rules = []
    for i, (name, schema) in enumerate(spec.tools):
        body = json.dumps({**schema, "x-guidance": CALL_JSON_OPTIONS}, ensure_ascii=False)
        rules.append(f"call_{i}: {_lit(fmt.call_prefix(name))} %json {body} {_lit('}')}")
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(spec.tools))))
    repeat = f" ({_text(fmt.separator, ids)} call)*" if spec.parallel else ""
    rules.append(_rule("calls", _text(fmt.open, ids), f"call{repeat}", _text(fmt.close, ids)))
    rules.append(_rule("calls_after_trigger", _text(fmt.open[len(fmt.trigger):], ids), f"call{repeat}",
                       _text(fmt.close, ids)))
    if spec.mode == "required":
        return _grammar(["calls"], rules)
    trigger_token = fmt.trigger in ids
    trigger = _text(fmt.trigger, ids)
    if spec.answer_schema is not None:  # auto with response_format: the answer, or calls
        answer = json.dumps({**spec.answer_schema, "x-guidance": ANSWER_JSON_OPTIONS}, ensure_ascii=False)
        rules.append(f"answer: %json {answer}")
        return _grammar(["answer", f"{trigger} calls_after_trigger" if trigger_token else "calls"], rules)
    if fmt.calls_at_start:  # free text, which may not open with "{" (that is a call)
        rules.append("TEXT: /[ \\t\\r\\n]*([^{ \\t\\r\\n](.|\\n)*)?/")
        starts = ["TEXT", "calls"] + ([f"TEXT {trigger} calls_after_trigger"] if trigger_token else [])
    elif trigger_token:  # a special token is never free text
        rules.append("TEXT: /(.|\\n)*/")
        starts = ["TEXT", f"TEXT {trigger} calls_after_trigger"]
    else:  # the free text may not spell the trigger; the lazy opening ends where it first does
        banned = escape_regex_literal(fmt.trigger).replace("/", "\\/")
        rules.append(f"TEXT: /(?s:.*)/ & ~/(?s:.*){banned}(?s:.*)/")
        rules.append(f"opening[lazy]: /(?s:.*)/ {_lit(fmt.trigger)}")
        starts = ["TEXT", "opening calls_after_trigger"]
    return _grammar(starts, rules)


def _rule(name: str, *items: str) -> str:
    return f"{name}: " + " ".join(item for item in items if item)


def _grammar(starts: list[str], rules: list[str]) -> str:
    return "\n".join(["%llguidance {}", "start: " + " | ".join(starts), *rules]) + "\n"


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _text(text: str, special_ids: Mapping[str, int]) -> str:
    """`text` as grammar items: special tokens as `<[id]>`, the pieces between them as literals."""
    if not text:
        return ""
    tokens = sorted((t for t in special_ids if t in text), key=len, reverse=True)
    if not tokens:
        return _lit(text)
    pattern = re.compile("(" + "|".join(re.escape(t) for t in tokens) + ")")
    items = []
    for piece in pattern.split(text):
        if not piece:
            continue
        items.append(f"<[{special_ids[piece]}]>" if piece in special_ids else _lit(piece))
    return " ".join(items)
