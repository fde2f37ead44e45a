from __future__ import annotations

import re

import pytest

from grammar import GrammarError, GrammarSpec


def test_schema_is_canonical_regardless_of_key_order_and_form():
    a = GrammarSpec.json_schema({"type": "object", "properties": {"b": {"type": "null"}, "a": {"type": "integer"}}})
    b = GrammarSpec.json_schema('{ "properties": {"a": {"type": "integer"}, "b": {"type": "null"}}, "type": "object" }')
    assert a == b and hash(a) == hash(b)
    assert a.value == '{"properties":{"a":{"type":"integer"},"b":{"type":"null"}},"type":"object"}'


def test_choice_is_canonical_and_escaped():
    spec = GrammarSpec.choice(["b", "a+b (c)", "b"])
    assert spec == GrammarSpec.choice(["a+b (c)", "b"])
    assert spec.choices() == ["a+b (c)", "b"]
    assert re.fullmatch(spec.as_regex(), "a+b (c)") and not re.fullmatch(spec.as_regex(), "aab (c)")


@pytest.mark.parametrize("make, message", [
    (lambda: GrammarSpec.json_schema("{not json"), "not valid JSON"),
    (lambda: GrammarSpec.json_schema("[1, 2]"), "must be a JSON object"),
    (lambda: GrammarSpec.json_schema({"minimum": float("nan")}), "not serialisable"),
    (lambda: GrammarSpec.regex(""), "non-empty string"),
    (lambda: GrammarSpec.choice([]), "non-empty list"),
    (lambda: GrammarSpec.choice("yes"), "non-empty list"),
    (lambda: GrammarSpec.choice(["ok", ""]), "non-empty strings"),
    (lambda: GrammarSpec("grammar", "x"), "unknown grammar kind"),
])
def test_bad_specs_are_refused_with_a_clear_message(make, message):
    with pytest.raises(GrammarError, match=message):
        make()


def test_json_object_and_accessors():
    assert GrammarSpec.json_object().schema() == {"type": "object"}
    with pytest.raises(GrammarError, match="has no JSON schema"):
        GrammarSpec.regex("a").schema()
