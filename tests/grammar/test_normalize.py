"""Normalization: annotations ignored, near-miss keywords and unenforceable ones refused by pointer and
name, draft-04/06/07 forms and $ref through $id anchors, limits that say which and by how much."""

from __future__ import annotations

import pytest

from grammar import GrammarCompiler, GrammarError, GrammarLimits, GrammarSpec, normalize_schema

D2020 = "https://json-schema.org/draft/2020-12/schema"
LLGUIDANCE_REFUSED = [
    ({"type": "array", "items": {"contains": {"type": "integer"}}}, "#/items/contains", "contains"),
    ({"type": "object", "unevaluatedItems": False}, "#/unevaluatedItems", "unevaluatedItems"),
]
OUTLINES_REFUSED = [
    ({"type": "integer", "minimum": 3}, "#/minimum", "minimum"),
    ({"type": "array", "items": {"type": "number", "maximum": 3}}, "#/items/maximum", "maximum"),
    ({"type": "integer", "multipleOf": 3}, "#/multipleOf", "multipleOf"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "#/patternProperties", "patternProperties"),
    ({"type": "object", "minProperties": 1}, "#/minProperties", "minProperties"),
]


@pytest.mark.parametrize("backend, schema, pointer, keyword", [
    *[("llguidance", *case) for case in LLGUIDANCE_REFUSED], *[("outlines", *case) for case in OUTLINES_REFUSED]
])
def test_unenforced_keywords_are_refused_by_name(compilers, backend, schema, pointer, keyword):
    with pytest.raises(GrammarError) as info:
        compilers("byte_bpe", backend).submit(GrammarSpec.json_schema(schema))
    assert f"at {pointer}: keyword {keyword!r} is not supported: the {backend} backend" in str(info.value)


def test_a_rewrite_the_backend_cannot_take_is_refused_by_name(compilers):
    with pytest.raises(GrammarError, match=r"at #/allOf: keyword 'allOf' is not supported: the outlines backend"):
        compilers("byte_bpe", "outlines").submit(GrammarSpec.json_schema(
            {"not": {"type": "string"}, "type": ["string", "integer"]}))


@pytest.mark.parametrize("schema, message", [
    ({"type": "strin"}, r"#/type: 'type' must be one of"),
    ({"type": "object", "properties": {"a": {"type": "integer", "maximun": 3}}},
     r"#/properties/a/maximun: unknown keyword 'maximun' looks like a misspelt 'maximum'"),
    ({"type": "array", "maxitems": 3}, r"#/maxitems: unknown keyword 'maxitems' looks like a misspelt 'maxItems'"),
    ({"type": "object", "patternPropertiez": {}}, r"'patternPropertiez' looks like a misspelt 'patternProperties'"),
    ({"type": "object", "Required": ["a"]}, r"'Required' looks like a misspelt 'required'"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, r"at #: unsatisfiable: minItems 3 > maxItems 2"),
    ({"type": "string", "maxLength": -1}, r"#/maxLength: 'maxLength' must be a non-negative integer"),
    ({"type": "string", "pattern": "(ab"}, r"#/pattern: invalid pattern"),
    ({"$ref": "#/$defs/missing"}, r"#/\$ref: unresolvable \$ref '#/\$defs/missing'"),
    ({"$ref": "https://example.com/s.json"}, r"#/\$ref: remote \$ref 'https://example.com/s.json' is not supported"),
    ({"$ref": "other.json#/a"}, r"remote \$ref 'other.json#/a'"),
    ({"type": "string", "format": "hostnme"}, r"#/format: format 'hostnme' looks like a misspelt 'hostname'"),
    ({"type": "string", "format": "iri"}, r"#/format: format 'iri' is not enforced by the llguidance backend"),
    ({"anyOf": []}, r"#/anyOf: 'anyOf' must be a non-empty list"),
    ({"$schema": D2020, "type": "array", "items": [{"type": "string"}]}, r"use prefixItems"),
    ({"$schema": D2020, "type": "number", "exclusiveMinimum": True, "minimum": 1},
     r"boolean 'exclusiveMinimum' is the draft-04 form"),
    ({"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False},
     r"required property 'a' is not in 'properties'"),
    ({"properties": {"a": 3}}, r"#/properties/a: a schema must be an object or a boolean"),
    ({"$dynamicRef": "#meta"}, r"#/\$dynamicRef: keyword '\$dynamicRef' is not supported"),
    ({"not": {}}, r"at #: the schema admits no instance"),
])
def test_invalid_schemas_fail_at_submission(compilers, schema, message):
    with pytest.raises(GrammarError, match=message):
        compilers("byte_bpe").submit(GrammarSpec.json_schema(schema))


def test_unknown_keywords_and_formats_are_annotations(compilers):
    """The specification: unknown keywords are annotations, unknown formats too (counted)."""
    schema = {"title": "T", "x-vendor": 1, "_format": "x", "self": {"vendor": "com.acme", "name": "e"},
              "markdownDescription": "d", "insertionOrder": False, "type": "object",
              "properties": {"n": {"type": "integer", "format": "int64", "minimum": 1}, "u": {"format": "url"}}}
    compiler: GrammarCompiler = compilers("byte_bpe")
    before = dict(compiler.stats.ignored_formats)
    compiled = compiler.compile(GrammarSpec.json_schema(schema))
    assert compiled.report is not None and compiled.report.ignored_formats == {"int64": 1, "url": 1}
    assert compiler.stats.ignored_formats["int64"] == before.get("int64", 0) + 1


def _normalized(compilers, schema):
    backend = compilers("byte_bpe").backend
    return normalize_schema(schema, backend, GrammarLimits()).schema


def test_a_schema_without_schema_is_read_in_the_draft_of_its_forms(compilers):
    from grammar.keywords import dialect_of

    assert dialect_of({"properties": {"n": {"minimum": 1, "exclusiveMinimum": True}}}) == "draft4"
    assert dialect_of({"dependencies": {"a": ["b"]}}) == "draft7"
    assert dialect_of({"properties": {"dependencies": {"type": "object"}}}) == "draft2020"  # a property name
    assert dialect_of({"$defs": {}}) == "draft2020"


def test_draft04_forms_become_2020_12(compilers):
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "id": "http://example.com/root.json",
              "type": "object",
              "properties": {"n": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 5,
                                   "exclusiveMaximum": False},
                             "t": {"type": "array", "items": [{"type": "string"}], "additionalItems": False},
                             "r": {"$ref": "#/definitions/r", "type": "string"}},
              "definitions": {"r": {"type": "integer"}}}
    out = _normalized(compilers, schema)
    assert out["properties"]["n"] == {"type": "number", "exclusiveMinimum": 0, "maximum": 5}
    assert out["properties"]["t"] == {"type": "array", "prefixItems": [{"type": "string"}], "items": False}
    r = out["properties"]["r"]  # draft-04: the siblings of $ref are ignored
    assert set(r) == {"$ref"} and out["$defs"][r["$ref"].split("/")[-1]] == {"type": "integer"}


def test_refs_resolve_through_ids_and_anchors(compilers):
    schema = {"$id": "https://example.com/root.json", "type": "object",
              "properties": {"a": {"$ref": "item.json"}, "b": {"$ref": "#num"},
                             "c": {"$ref": "https://example.com/item.json#/properties/k"}},
              "$defs": {"item": {"$id": "item.json", "type": "object", "properties": {"k": {"const": 1}}},
                        "n": {"$anchor": "num", "type": "number"}}}
    out = _normalized(compilers, schema)
    defs = out["$defs"]
    target = lambda name: defs[out["properties"][name]["$ref"].split("/")[-1]]  # noqa: E731
    assert target("a")["type"] == "object" and target("b") == {"type": "number"} and target("c") == {"const": 1}
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "properties": {"p": {"$ref": "#plain"}},
              "definitions": {"x": {"$id": "#plain", "type": "boolean"}}}
    assert list(_normalized(compilers, draft7)["$defs"].values()) == [{"type": "boolean"}]


def test_limits_name_the_limit_and_the_excess(tokenizer_infos):
    compiler = GrammarCompiler(tokenizer_infos["byte_bpe"], limits=GrammarLimits(max_spec_chars=50, max_schema_nodes=3))
    with pytest.raises(GrammarError, match=r"\d+ characters, \d+ over the limit of 50 \(GrammarLimits.max_spec_chars\)"):
        compiler.submit(GrammarSpec.json_schema({"description": "x" * 60}))
    with pytest.raises(GrammarError, match=r"5 subschemas, 2 over the limit of 3 \(GrammarLimits.max_schema_nodes\)"):
        compiler.submit(GrammarSpec.json_schema({"properties": {"a": {}, "b": {}, "c": {}, "d": {}}}))
    compiler.shutdown()


def test_ref_chain_deeper_than_the_limit_is_refused(compilers):
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(40)}
    defs["d40"] = {"type": "integer"}
    with pytest.raises(GrammarError, match=r"over the limit of 32 \(GrammarLimits.max_ref_depth\)"):
        compilers("byte_bpe").submit(GrammarSpec.json_schema({"$defs": defs, "$ref": "#/$defs/d0"}))


def test_exponential_ref_expansion_compiles_once_per_target(compilers):
    defs = {f"d{i}": {"type": "array", "prefixItems": [{"$ref": f"#/$defs/d{i + 1}"}] * 2} for i in range(15)}
    defs["d15"] = {"type": "null"}
    compiled = compilers("byte_bpe").compile(GrammarSpec.json_schema({"$defs": defs, "$ref": "#/$defs/d0"}))
    assert compiled.matcher() is not None
