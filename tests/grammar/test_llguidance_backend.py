"""Every output of the default backend that finishes with "stop" parses and validates.

20 schemas x both tokenizer kinds x 10 seeds, sampled at temperature 1.0 from random logits over
the masked distribution; plus regex, choice and json_object.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from grammar import GrammarSpec
from tests.grammar.constrained_sampling import KINDS, decode, validate
from tests.grammar.constrained_sampling import sample_constrained as sample

SCHEMAS: dict[str, dict] = json.loads((Path(__file__).parent / "schemas.json").read_text())
SEEDS = range(10)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_outputs_validate(name, kind, compilers, tokenizer_infos, tokenizers):
    schema = SCHEMAS[name]
    compiled = compilers(kind).compile(GrammarSpec.json_schema(schema))
    stops = 0
    for seed in SEEDS:
        ids, finish = sample(compiled, tokenizer_infos[kind], seed, max_tokens=200)
        if finish != "stop":
            continue
        stops += 1
        text = decode(tokenizers[kind], tokenizer_infos[kind], ids)
        if compiled.guard.check(text) is not None:
            # only where the grammar approximates (date-time, time): the guard fails such an output
            assert compiled.report.approximations, (name, text)
            continue
        validate(json.loads(text), schema)
    assert stops >= 3, f"only {stops}/10 samples finished: the check would be vacuous"


REGEXES = [r"[a-z]{2,6}", r"(yes|no|maybe)!?", r"-?[0-9]{1,4}\.[0-9]{2}", r"[A-F0-9]{4}-[a-z ]{1,5}"]


@pytest.mark.parametrize("kind", KINDS)
def test_regex_outputs_match(kind, compilers, tokenizer_infos, tokenizers):
    for pattern in REGEXES:
        compiled = compilers(kind).compile(GrammarSpec.regex(pattern))
        finished = 0
        for seed in SEEDS:
            ids, finish = sample(compiled, tokenizer_infos[kind], seed)
            assert finish == "stop", (pattern, seed)  # every regex here has a short bounded match
            finished += 1
            text = decode(tokenizers[kind], tokenizer_infos[kind], ids)
            assert re.fullmatch(pattern, text), (pattern, text)
        assert finished == len(SEEDS)


@pytest.mark.parametrize("kind", KINDS)
def test_choice_outputs_are_options(kind, compilers, tokenizer_infos, tokenizers):
    options = ["yes", "no", "the model", "日本語", "a+b (c)"]
    compiled = compilers(kind).compile(GrammarSpec.choice(options))
    seen = set()
    for seed in range(20):
        ids, finish = sample(compiled, tokenizer_infos[kind], seed)
        assert finish == "stop"
        text = decode(tokenizers[kind], tokenizer_infos[kind], ids)
        assert text in options, text
        seen.add(text)
    assert len(seen) >= 2, "random sampling should reach more than one option"


@pytest.mark.parametrize("kind", KINDS)
def test_json_object_outputs_are_objects(kind, compilers, tokenizer_infos, tokenizers):
    compiled = compilers(kind).compile(GrammarSpec.json_object())
    stops = 0
    for seed in SEEDS:
        ids, finish = sample(compiled, tokenizer_infos[kind], seed, max_tokens=200)
        if finish == "stop":
            stops += 1
            assert isinstance(json.loads(decode(tokenizers[kind], tokenizer_infos[kind], ids)), dict)
    assert stops >= 3


@pytest.mark.parametrize("kind", KINDS)
def test_eos_only_when_accepting_and_specials_never(kind, compilers, tokenizer_infos):
    info = tokenizer_infos[kind]
    matcher = compilers(kind).compile(GrammarSpec.choice(["ab"])).matcher()
    eos = info.eos_token_ids[0]
    specials = sorted(info.special_token_ids - set(info.eos_token_ids))
    assert not matcher.is_accepting()
    assert not matcher.accept_token(eos)
    assert not any(matcher.accept_token(s) for s in specials)
    a_token = info.token_bytes.index(b"a")
    b_token = info.token_bytes.index(b"b")
    assert not matcher.accept_token(b_token), "out-of-grammar token accepted"
    assert matcher.accept_token(a_token) and matcher.accept_token(b_token)
    assert matcher.is_accepting() and matcher.is_terminated()
