"""Schemas a backend would not enforce, and invalid schemas, are refused naming pointer and keyword."""

from __future__ import annotations

import pytest

from grammar import GrammarError, GrammarSpec

LLGUIDANCE_REFUSED = [
    ({"type": "array", "uniqueItems": True}, "#/uniqueItems", "uniqueItems"),
    ({"properties": {"a": {"not": {"type": "string"}}}}, "#/properties/a/not", "not"),
    ({"type": "array", "items": {"contains": {"type": "integer"}}}, "#/items/contains", "contains"),
    ({"type": "object", "propertyNames": {"maxLength": 2}}, "#/propertyNames", "propertyNames"),
    ({"if": {"type": "string"}, "then": {"maxLength": 2}}, "#/if", "if"),
]
OUTLINES_REFUSED = [
    ({"type": "integer", "minimum": 3}, "#/minimum", "minimum"),
    ({"type": "array", "items": {"type": "number", "maximum": 3}}, "#/items/maximum", "maximum"),
    ({"type": "integer", "multipleOf": 3}, "#/multipleOf", "multipleOf"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "#/patternProperties", "patternProperties"),
    ({"type": "object", "minProperties": 1}, "#/minProperties", "minProperties"),
    ({"allOf": [{"type": "integer"}]}, "#/allOf", "allOf"),
    ({"type": "array", "uniqueItems": True}, "#/uniqueItems", "uniqueItems"),
]


@pytest.mark.parametrize("backend, schema, pointer, keyword", [
    *[("llguidance", *case) for case in LLGUIDANCE_REFUSED], *[("outlines", *case) for case in OUTLINES_REFUSED]
])
def test_unenforced_keywords_are_refused_by_name(compilers, backend, schema, pointer, keyword):
    with pytest.raises(GrammarError) as info:
        compilers("byte_bpe", backend).submit(GrammarSpec.json_schema(schema))
    assert f"at {pointer}: keyword {keyword!r} is not supported: the {backend} backend" in str(info.value)


@pytest.mark.parametrize("schema, message", [
    ({"type": "strin"}, r"#/type: 'type' must be one of"),
    ({"type": "object", "properties": {"a": {"type": "integer", "maximun": 3}}},
     r"#/properties/a/maximun: unknown keyword 'maximun'"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, r"at #: unsatisfiable: minItems 3 > maxItems 2"),
    ({"type": "string", "maxLength": -1}, r"#/maxLength: 'maxLength' must be a non-negative integer"),
    ({"type": "string", "pattern": "(ab"}, r"#/pattern: invalid pattern"),
    ({"$ref": "#/$defs/missing"}, r"#/\$ref: unresolvable \$ref '#/\$defs/missing'"),
    ({"$ref": "https://example.com/s.json"}, r"only local JSON-pointer \$refs"),
    ({"type": "string", "format": "hostnme"}, r"#/format: format 'hostnme' is not enforced"),
    ({"anyOf": []}, r"#/anyOf: 'anyOf' must be a non-empty list"),
    ({"type": "array", "items": [{"type": "string"}]}, r"use prefixItems"),
    ({"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False},
     r"required property 'a' is not in 'properties'"),
    ({"properties": {"a": 3}}, r"#/properties/a: a schema must be an object or a boolean"),
])
def test_invalid_schemas_fail_at_submission(compilers, schema, message):
    with pytest.raises(GrammarError, match=message):
        compilers("byte_bpe").submit(GrammarSpec.json_schema(schema))


def test_ref_chain_deeper_than_the_limit_is_refused(compilers):
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(20)}
    defs["d20"] = {"type": "integer"}
    with pytest.raises(GrammarError, match=r"\$ref chain deeper than the limit of 16"):
        compilers("byte_bpe").submit(GrammarSpec.json_schema({"$defs": defs, "$ref": "#/$defs/d0"}))


def test_exponential_ref_expansion_is_refused(compilers):
    defs = {f"d{i}": {"type": "array", "prefixItems": [{"$ref": f"#/$defs/d{i + 1}"}] * 2} for i in range(15)}
    defs["d15"] = {"type": "null"}
    with pytest.raises(GrammarError, match="too large to check"):
        compilers("byte_bpe").submit(GrammarSpec.json_schema({"$defs": defs, "$ref": "#/$defs/d0"}))


def test_annotations_and_extensions_are_allowed(compilers):
    schema = {"title": "T", "description": "d", "x-vendor": 1, "$schema": "https://json-schema.org/draft/2020-12/schema",
              "type": "integer", "minimum": 1, "maximum": 3, "examples": [2]}
    compilers("byte_bpe").compile(GrammarSpec.json_schema(schema))
