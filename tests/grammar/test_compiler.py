"""GrammarCompiler: cache by canonical spec + tokenizer fingerprint, thread pool, time and size limits."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from grammar import GrammarCompiler, GrammarError, GrammarLimits, GrammarSpec
from tests.grammar.constrained_sampling import greedy_ids, sample_constrained

SCHEMAS: dict[str, dict] = json.loads((Path(__file__).parent / "schemas.json").read_text())
SLOW_REGEX = r"(a|b)*a(a|b){10}"  # its DFA has ~2^11 states: ~40 ms to index with outlines-core


def test_cache_hit_skips_the_backend_and_key_is_canonical(tokenizer_infos, monkeypatch):
    compiler = GrammarCompiler(tokenizer_infos["byte_bpe"])
    schema = SCHEMAS["nested_object"]
    first = compiler.compile(GrammarSpec.json_schema(schema))
    reordered = json.dumps(dict(reversed(list(schema.items()))), indent=2)

    def compiled_again(*args, **kwargs):
        raise AssertionError("a cache hit reached the backend")

    monkeypatch.setattr(compiler.backend, "compile", compiled_again)
    again = compiler.compile(GrammarSpec.json_schema(reordered))
    assert again is first
    assert (compiler.cache_hits, compiler.cache_misses) == (1, 1)
    compiler.shutdown()


def test_cache_is_per_tokenizer_and_lru_bounded(tokenizer_infos):
    spec = GrammarSpec.regex("[a-z]+")
    a = GrammarCompiler(tokenizer_infos["byte_bpe"], cache_size=2)
    b = GrammarCompiler(tokenizer_infos["sentencepiece"])
    assert tokenizer_infos["byte_bpe"].fingerprint != tokenizer_infos["sentencepiece"].fingerprint
    assert a._key(spec) != b._key(spec)
    for pattern in ("[a-z]+", "[0-9]+", "x+"):
        a.compile(GrammarSpec.regex(pattern))
    assert a.num_cached() == 2
    a.compile(GrammarSpec.regex("x+"))
    a.compile(GrammarSpec.regex("[a-z]+"))  # evicted as least recently used: compiled again
    assert (a.cache_hits, a.cache_misses) == (1, 4)
    a.shutdown()
    b.shutdown()


def test_submit_does_not_block_and_dedupes_in_flight(tokenizer_infos, monkeypatch):
    compiler = GrammarCompiler(tokenizer_infos["byte_bpe"], backend="outlines", timeout_s=30)
    gate, calls, real_compile = threading.Event(), [], compiler.backend.compile

    def held(*args, **kwargs):  # the compile cannot finish until the test lets it
        calls.append(args)
        assert gate.wait(timeout=30)
        return real_compile(*args, **kwargs)

    monkeypatch.setattr(compiler.backend, "compile", held)
    first = compiler.submit(GrammarSpec.regex(SLOW_REGEX))
    second = compiler.submit(GrammarSpec.regex(SLOW_REGEX))
    assert not first.done(), "submit waited for the compile"
    assert second is first
    gate.set()
    assert first.result(timeout=30).matcher() is not None
    assert len(calls) == 1  # the in-flight compile was shared, not started twice
    compiler.shutdown()


def test_compile_past_the_time_limit_fails_with_grammar_error(tokenizer_infos):
    compiler = GrammarCompiler(tokenizer_infos["byte_bpe"], backend="outlines", timeout_s=0.005)
    future = compiler.submit(GrammarSpec.regex(SLOW_REGEX))
    with pytest.raises(GrammarError, match="longer than the compile time limit of 0.005 s"):
        future.result(timeout=30)
    time.sleep(0.2)  # the worker finishes in the background; its late result is not cached
    assert compiler.num_cached() == 0
    compiler.shutdown()


@pytest.mark.parametrize("backend, limits, spec, message", [
    ("outlines", GrammarLimits(max_states=100), GrammarSpec.regex(SLOW_REGEX), "too large: its automaton has"),
    ("llguidance", GrammarLimits(max_grammar_symbols=20), GrammarSpec.json_schema(SCHEMAS["defs_ref"]),
     r"^json_schema at #: refused by the llguidance backend: grammar size .*"
     r"\(GrammarLimits.max_grammar_symbols = 20\)$"),
    ("llguidance", GrammarLimits(max_spec_chars=50), GrammarSpec.json_schema(SCHEMAS["nested_object"]),
     "too large: .* characters"),
])
def test_size_limits(tokenizer_infos, backend, limits, spec, message):
    compiler = GrammarCompiler(tokenizer_infos["byte_bpe"], backend=backend, limits=limits)
    with pytest.raises(GrammarError, match=message):
        compiler.compile(spec)
    compiler.shutdown()


def test_invalid_regex_is_refused_at_submission_by_either_backend(compilers):
    for backend in ("llguidance", "outlines"):
        compiler = compilers("byte_bpe", backend)
        with pytest.raises(GrammarError, match="invalid regex '\\(\\?=a\\)b': look-around"):
            compiler.submit(GrammarSpec.regex("(?=a)b"))
        with pytest.raises(GrammarError, match="unclosed group"):
            compiler.check(GrammarSpec.regex("(unclosed"))


@pytest.mark.parametrize("backend", ["llguidance", "outlines"])
def test_rollback_undoes_tokens_and_an_accepted_eos(compilers, tokenizer_infos, backend):
    info = tokenizer_infos["byte_bpe"]
    matcher = compilers("byte_bpe", backend).compile(GrammarSpec.json_schema({"type": "integer"})).matcher()
    ids = greedy_ids(info, "123")
    assert all(matcher.accept_token(t) for t in ids)
    assert matcher.accept_token(info.eos_token_ids[0]) and matcher.is_terminated()
    matcher.rollback(1)  # the EOS
    assert not matcher.is_terminated() and matcher.is_accepting()
    matcher.rollback(len(ids))
    assert not matcher.is_accepting()
    assert not matcher.accept_token(greedy_ids(info, "}")[0]) and matcher.accept_token(ids[0])


def test_unknown_backend_and_bad_settings(tokenizer_infos):
    with pytest.raises(ValueError, match="unknown grammar backend 'xgrammar'"):
        GrammarCompiler(tokenizer_infos["byte_bpe"], backend="xgrammar")
    with pytest.raises(ValueError, match="timeout_s > 0"):
        GrammarCompiler(tokenizer_infos["byte_bpe"], timeout_s=0)


# Keys of 1 to 320 characters, unanchored: llguidance's lexer builds many expressions for it per token.
LONG_KEYS = {"type": "object", "additionalProperties": False, "patternProperties": {".{1,320}": {"type": "integer"}}}


def test_a_grammar_whose_lexer_fails_is_dropped_from_the_cache(tokenizer_infos):
    """llguidance's matchers share their grammar's lexer: one that runs out of lexer fuel fails every later
    matcher of that grammar too. The grammar is marked broken and the next submit compiles it afresh."""
    info = tokenizer_infos["byte_bpe"]
    compiler = GrammarCompiler(info, limits=GrammarLimits(step_lexer_fuel=1000))
    spec = GrammarSpec.json_schema(LONG_KEYS)
    grammar = compiler.compile(spec)
    with pytest.raises(AssertionError, match="refused its own allowed token"):
        sample_constrained(grammar, info, 0, max_tokens=200)
    assert grammar.broken is not None and "lexer error" in grammar.broken
    again = compiler.compile(spec)
    assert again is not grammar and again.broken is None and compiler.stats.evicted_broken == 1
    compiler.shutdown()


def test_the_default_lexer_fuel_serves_a_corpus_schema_whose_keys_ran_it_out(tokenizer_infos):
    """cloudformation/AWS::SageMaker::TrialComponent (`.{1,320}` keys of nested objects): with llguidance's
    own step fuel (200,000) seed 0 ran the lexer out mid-key; GrammarLimits' default is enough."""
    from tests.grammar.test_corpus import CORPUS

    schema = next(e["schema"] for e in CORPUS if e["name"] == "cloudformation/AWS::SageMaker::TrialComponent")
    info = tokenizer_infos["byte_bpe"]
    for limits, fails in ((GrammarLimits(step_lexer_fuel=200_000), True), (GrammarLimits(), False)):
        compiler = GrammarCompiler(info, limits=limits)
        grammar = compiler.compile(GrammarSpec.json_schema(schema))
        if fails:
            with pytest.raises(AssertionError, match="refused its own allowed token"):
                sample_constrained(grammar, info, 0, max_tokens=120)
        else:
            for seed in range(5):
                sample_constrained(grammar, info, seed, max_tokens=120)
            assert grammar.broken is None
        compiler.shutdown()
