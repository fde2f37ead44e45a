"""The output guard's regex re-check, and backend refusals pointed at (grammar/locate.py)."""

from __future__ import annotations

import re

import pytest

from grammar import GrammarError, GrammarSpec, OutputGuard
from grammar.guard import rechecks_regex
from tests.grammar.constrained_sampling import KINDS, decode, sample_constrained

# Patterns in the syntax both dialects read alike: Unicode classes, counted repeats, alternation.
PATTERNS = [r"[a-z]{2,6}-[0-9]{3}", r"\d{1,4}(\.\d{2})?", r"(?:yes|no|maybe)!?", r"\w+ \w+", r"\p{L}{1,5}",
            r"[A-Z][a-z]*(, [A-Z][a-z]*){0,2}"]


def test_regex_outputs_are_rechecked():
    guard = OutputGuard(GrammarSpec.regex(r"[a-z]{2,6}-[0-9]{3}"))
    assert guard.check("ab-123") is None
    assert guard.check("ab-1234") == "the output does not match the regex"
    assert guard.check("ab-123\n") == "the output does not match the regex"  # a full match: no trailing newline
    assert guard.check("ab_123") is not None


@pytest.mark.parametrize("pattern, rechecked", [
    (r"(?:ab)+c", True), (r"\p{Greek}+", True), (r"(?i)abc", False), (r"[[:alpha:]]+", False),
    (r"[a-z&&[^aeiou]]+", False), (r"ab\z", False),
])
def test_rust_only_syntax_is_not_rechecked(pattern, rechecked):
    assert rechecks_regex(pattern) is rechecked
    guard = OutputGuard(GrammarSpec.regex(pattern))
    # a pattern the guard does not read passes everything; one it reads refuses a non-match
    assert (guard.check("\u0000no match\u0000") is not None) is rechecked


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_regex_outputs_pass_the_guard(kind, compilers, tokenizer_infos, tokenizers):
    """No false alarm: whatever the grammar lets finish, the re-check (another regex engine) accepts."""
    finished = 0
    for pattern in PATTERNS:
        compiled = compilers(kind).compile(GrammarSpec.regex(pattern))
        for seed in range(5):
            ids, finish = sample_constrained(compiled, tokenizer_infos[kind], seed, max_tokens=40)
            if finish != "stop":
                continue
            text = decode(tokenizers[kind], tokenizer_infos[kind], ids)
            assert compiled.guard.check(text) is None, (pattern, text)
            finished += 1
    assert finished >= 15


@pytest.mark.parametrize("schema, pointer, detail", [
    # llguidance cannot tell these patternProperties apart (one comes from the propertyNames rewrite)
    ({"type": "object", "propertyNames": {"maxLength": 255},
      "patternProperties": {"^[a-zA-Z0-9]+$": {"type": "string"}}},
     "#/patternProperties/^[a-zA-Z0-9]+$", "are not disjoint"),
    # llguidance names the normalized schema's $defs entry: the message names the sent definition
    ({"definitions": {"t": {"type": "object", "properties": {"a": {"type": "string"}}, "minProperties": 1}},
      "type": "object", "properties": {"x": {"$ref": "#/definitions/t"}}},
     "#/definitions/t", "min/maxProperties only supported"),
    # a pattern llguidance cannot intersect with the length bounds: its message spells \\w (also inside a
    # class) as [0-9a-zA-Z_] (corpus: cloudformation/AWS::WorkSpacesWeb::Portal)
    ({"type": "object", "properties": {"name": {"type": "string"}, "arn": {
        "type": "string", "minLength": 20, "maxLength": 2048,
        "pattern": "^arn:[\\w+=\\/,.@-]+:[a-zA-Z0-9\\-]+:[a-zA-Z0-9\\-]*:[a-zA-Z0-9]{1,12}:[a-zA-Z]+(\\/[a-fA-F0-9\\-]{36})+$"}}},
     "#/properties/arn/pattern", "Unable to determine if regex is empty"),
    # over llguidance's fixed budget of schema nodes: 12 if/then in one allOf multiply out to 2**12
    # branches; the pointer names the definition where that happens, not the root or the array
    # (corpus: schemastore/github-issue-forms, schemastore/azure-pipelines)
    ({"definitions": {"item": {"type": "object", "allOf": [
        {"if": {"properties": {"kind": {"const": f"k{i}"}}}, "then": {"properties": {f"p{i}": {"type": "string"}}}}
        for i in range(12)]}},
      "type": "object", "properties": {"name": {"type": "string"},
                                       "items": {"type": "array", "items": {"$ref": "#/definitions/item"}}}},
     "#/definitions/item", "schema too large: over the llguidance JSON compiler's fixed limit of 50000"),
])
def test_llguidance_refusals_name_a_pointer(compilers, schema, pointer, detail):
    with pytest.raises(GrammarError) as refused:
        compilers("byte_bpe").compile(GrammarSpec.json_schema(schema))
    message = str(refused.value)
    assert message.startswith(f"json_schema at {pointer}: refused by the llguidance backend: "), message
    assert detail in message and "json-schema:///" not in message and "$defs/d0" not in message


def test_a_refusal_without_a_place_points_at_the_root(compilers):
    schema = {"type": "object", "properties": {"x": {"type": "object", "properties": {"a": {"type": "string"}},
                                                     "maxProperties": 1}}}
    with pytest.raises(GrammarError, match=re.escape("json_schema at #: refused by the llguidance backend: ")):
        compilers("byte_bpe").compile(GrammarSpec.json_schema(schema))
