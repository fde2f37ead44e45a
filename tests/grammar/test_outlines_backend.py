"""outlines-core backend: what it accepts is enforced; what it would ignore is refused by name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from grammar import GrammarError, GrammarSpec
from tests.grammar.constrained_sampling import KINDS, decode, validate
from tests.grammar.constrained_sampling import sample_constrained as sample

SCHEMAS: dict[str, dict] = json.loads((Path(__file__).parent / "schemas.json").read_text())
RANGE = r"keyword '(maximum|exclusiveMaximum)' is not supported"
# Which of the 20 schemas outlines refuses, and what its message must say (pointer and keyword).
REFUSED = {
    "nested_object": "#/properties/user/properties/age/maximum: " + RANGE,
    "int_array_bounded": "#/items/maximum: " + RANGE,
    "any_of": "#/anyOf/0/maximum: " + RANGE,
    "defs_ref": "#/\\$defs/point/properties/x/maximum: " + RANGE,
    "negative_int_range": "#/maximum: " + RANGE,
    "number_range": "#/exclusiveMaximum: " + RANGE,
    "multiple_of": "#/maximum: " + RANGE,
    "optional_fields": "#/properties/id/maximum: " + RANGE,
    "recursive_tree": "#/\\$defs/node/properties/kids/items/\\$ref: recursive",
    "tuple_items": "#/prefixItems/1/maximum: " + RANGE,
    "format_date": "#/format: format 'date' is not enforced by the outlines backend",
    "format_date_time": "#/format: format 'date-time' is not enforced",
    "format_email": "#/format: format 'email' is not enforced",
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_enforced_or_refused(name, kind, compilers, tokenizer_infos, tokenizers):
    schema = SCHEMAS[name]
    compiler = compilers(kind, "outlines")
    if name in REFUSED:
        with pytest.raises(GrammarError, match=REFUSED[name]):
            compiler.submit(GrammarSpec.json_schema(schema))
        return
    compiled = compiler.compile(GrammarSpec.json_schema(schema))
    stops = 0
    for seed in range(10):
        ids, finish = sample(compiled, tokenizer_infos[kind], seed, max_tokens=200)
        if finish == "stop":
            stops += 1
            validate(json.loads(decode(tokenizers[kind], tokenizer_infos[kind], ids)), schema)
    assert stops >= 3


def test_recursive_ref_is_refused(compilers):
    schema = {"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}, "$ref": "#/$defs/n"}
    with pytest.raises(GrammarError, match=r"recursive \$ref '#/\$defs/n'.*outlines"):
        compilers("byte_bpe", "outlines").submit(GrammarSpec.json_schema(schema))


@pytest.mark.parametrize("kind", KINDS)
def test_regex_and_choice(kind, compilers, tokenizer_infos, tokenizers):
    compiler = compilers(kind, "outlines")
    for spec, check in [
        (GrammarSpec.regex(r"[a-z]{2,6}"), lambda t: re.fullmatch(r"[a-z]{2,6}", t)),
        (GrammarSpec.choice(["yes", "no", "a+b (c)"]), lambda t: t in ("yes", "no", "a+b (c)")),
    ]:
        compiled = compiler.compile(spec)
        for seed in range(10):
            ids, finish = sample(compiled, tokenizer_infos[kind], seed)
            assert finish == "stop"
            assert check(decode(tokenizers[kind], tokenizer_infos[kind], ids))
