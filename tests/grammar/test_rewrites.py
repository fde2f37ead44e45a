"""Each exact rewrite admits exactly what the schema admits: the grammar agrees with python-jsonschema on
instances on both sides of the boundary, and a rewrite that cannot be exact is refused."""

from __future__ import annotations

import pytest

from grammar import GrammarError, GrammarSpec
from grammar.guard import schema_validator
from grammar.rewrites import complement_regex
from tests.grammar.constrained_sampling import accepts_in_some_order


def check(compilers, tokenizer_infos, schema: dict, instances: list, kind: str = "byte_bpe") -> None:
    compiled = compilers(kind).compile(GrammarSpec.json_schema(schema))
    validator = schema_validator(schema)
    for instance in instances:
        expected = validator.is_valid(instance)
        assert accepts_in_some_order(compiled, tokenizer_infos[kind], instance) == expected, (instance, expected)


OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}}}


@pytest.mark.parametrize("key, value", [
    ("dependencies", {"a": ["b"]}), ("dependentRequired", {"a": ["b"]}),
])
def test_property_dependencies(compilers, tokenizer_infos, key, value):
    check(compilers, tokenizer_infos, {**OBJ, key: value},
          [{}, {"a": 1}, {"b": "x"}, {"a": 1, "b": "x"}, {"a": 1, "c": True}, {"c": False}])


@pytest.mark.parametrize("key, value", [
    ("dependencies", {"a": {"required": ["c"], "properties": {"b": {"maxLength": 1}}}}),
    ("dependentSchemas", {"a": {"required": ["c"], "properties": {"b": {"maxLength": 1}}}}),
    ("dependentSchemas", {"a": False}),
])
def test_schema_dependencies(compilers, tokenizer_infos, key, value):
    check(compilers, tokenizer_infos, {**OBJ, key: value},
          [{}, {"a": 1}, {"a": 1, "c": True}, {"a": 1, "b": "xy", "c": True}, {"a": 1, "b": "x", "c": True},
           {"b": "xyz"}])


def test_draft04_document(compilers, tokenizer_infos):
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
              "properties": {"n": {"type": "integer", "minimum": 0, "exclusiveMinimum": True, "maximum": 3,
                                   "exclusiveMaximum": True},
                             "t": {"type": "array", "items": [{"type": "integer"}, {"type": "string"}],
                                   "additionalItems": False},
                             "k": {"$ref": "#/definitions/k"}},
              "dependencies": {"k": ["n"]}, "definitions": {"k": {"enum": ["x", "y"]}}}
    check(compilers, tokenizer_infos, schema,
          [{"n": 0}, {"n": 1}, {"n": 2}, {"n": 3}, {"t": [1, "a"]}, {"t": [1, "a", 2]}, {"t": [1]}, {"t": ["a"]},
           {"k": "x"}, {"k": "x", "n": 1}, {"k": "z", "n": 1}])


@pytest.mark.parametrize("branches, instances", [
    ([{"type": "string"}, {"type": "integer"}], ["a", 1, 1.5, None]),  # distinct types
    ([{"type": ["string", "null"]}, {"type": ["integer", "null"]}], ["a", 1, None]),  # overlap on null only
    ([{"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}, "required": ["kind"]},
      {"type": "object", "properties": {"kind": {"enum": ["b", "c"]}}, "required": ["kind"]}],
     [{"kind": "a"}, {"kind": "b"}, {"kind": "a", "x": 1}, {"kind": "d"}, {}]),  # discriminator
    ([{"required": ["x"]}, {"required": ["y"]}, {"required": ["z"]}],
     [{}, {"x": 1}, {"y": 1}, {"x": 1, "y": 2}, {"z": 1}, {"x": 1, "y": 1, "z": 1}, "s"]),  # exactly one of
    ([{"type": "object", "properties": {"x": {}}, "required": ["x"], "additionalProperties": False},
      {"type": "object", "properties": {"y": {}}, "required": ["y"], "additionalProperties": False}],
     [{"x": 1}, {"y": 1}, {"x": 1, "y": 1}]),  # a property one requires and the other forbids
])
def test_one_of_rewrites_exactly(compilers, tokenizer_infos, branches, instances):
    check(compilers, tokenizer_infos, {"oneOf": branches}, instances)


def test_overlapping_one_of_is_refused(compilers):
    schema = {"oneOf": [{"type": "string", "pattern": "^a"}, {"type": "string", "pattern": "b$"}]}
    with pytest.raises(GrammarError, match=r"#/oneOf: oneOf branches 0 and 1 may both match one instance"):
        compilers("byte_bpe").submit(GrammarSpec.json_schema(schema))


@pytest.mark.parametrize("negated, instances", [
    ({"type": "string"}, ["a", 1, None, True, {}, []]),
    ({"type": ["number", "null"]}, [1, 1.5, None, "x"]),
    ({"const": "red"}, ["red", "re", "redd", "", "blue", 1]),
    ({"enum": ["a", "ab", 3, None, True]}, ["a", "ab", "abc", "b", "", 3, 2, 4, 3.5, None, True, False]),
    ({"required": ["a", "b"]}, [{}, {"a": 1}, {"a": 1, "b": 2}, "s"]),
    ({"minLength": 2}, ["", "a", "ab", 5]),
    ({"maximum": 3}, [2, 3, 4, "x"]),
    ({"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"]}, [{"a": 1}, {"a": 2}, {}, 7]),
    ({"anyOf": [{"type": "string"}, {"required": ["a"]}]}, ["s", {"a": 1}, {"b": 1}, 1]),
    ({"not": {"type": "integer"}}, [1, 1.5, "x"]),
])
def test_not_rewrites_exactly(compilers, tokenizer_infos, negated, instances):
    check(compilers, tokenizer_infos, {"not": negated}, instances)


def test_not_without_exact_form_is_refused_when_approximation_is_off(tokenizer_infos):
    from grammar import GrammarCompiler

    compiler = GrammarCompiler(tokenizer_infos["byte_bpe"], allow_approximate=False)
    with pytest.raises(GrammarError, match=r"#/not/pattern: 'not' of 'pattern' has no exact positive form"):
        compiler.submit(GrammarSpec.json_schema({"type": "string", "not": {"pattern": "^a"}}))
    with pytest.raises(GrammarError, match=r"#/uniqueItems: keyword 'uniqueItems' is not supported"):
        compiler.submit(GrammarSpec.json_schema({"type": "array", "uniqueItems": True}))
    compiler.shutdown()


def test_if_then_else(compilers, tokenizer_infos):
    schema = {"type": "object", "properties": {"kind": {"enum": ["card", "bank"]}, "number": {"type": "string"},
                                               "iban": {"type": "string"}},
              "if": {"properties": {"kind": {"const": "card"}}}, "then": {"required": ["number"]},
              "else": {"required": ["iban"]}}
    check(compilers, tokenizer_infos, schema,
          [{"kind": "card"}, {"kind": "card", "number": "1"}, {"kind": "bank", "number": "1"},
           {"iban": "x", "kind": "bank"}, {"number": "1"}, {"iban": "x"}])


@pytest.mark.parametrize("names, instances", [
    ({"pattern": "^[a-z]+$"}, [{"ab": 1}, {"Ab": 1}, {}]),
    ({"maxLength": 2}, [{"ab": 1}, {"abc": 1}]),
    ({"enum": ["x", "y"]}, [{"x": 1}, {"z": 1}, {"x": 1, "y": 2}]),
])
def test_property_names(compilers, tokenizer_infos, names, instances):
    check(compilers, tokenizer_infos, {"type": "object", "propertyNames": names}, instances)


def test_unevaluated_properties_as_additional_properties(compilers, tokenizer_infos):
    schema = {"$defs": {"base": {"properties": {"id": {"type": "integer"}}}},
              "allOf": [{"$ref": "#/$defs/base"}], "properties": {"name": {"type": "string"}},
              "unevaluatedProperties": False}
    check(compilers, tokenizer_infos, schema, [{"id": 1}, {"id": 1, "name": "n"}, {"other": 1}])


@pytest.mark.parametrize("words", [["ab"], ["a", "ab", ""], ["x-y", "[", "]", "^"]])
def test_complement_regex(words):
    import re

    pattern = re.compile(complement_regex(words))
    for probe in ["", "a", "ab", "abc", "b", "x-y", "x-", "[", "]", "^", "\n", "ab\n"]:
        assert bool(pattern.match(probe)) == (probe not in words), probe


def test_formats_rewritten_to_patterns(compilers, tokenizer_infos):
    check(compilers, tokenizer_infos, {"type": "string", "format": "json-pointer"},
          ["", "/a/b", "/a~1b", "a", "/~2"])
    check(compilers, tokenizer_infos, {"type": "string", "format": "uri-reference"},
          ["", "a/b", "http://x.org/p?q#f", "//host:80/", "%zz", "a b"])
