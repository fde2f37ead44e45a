"""GrammarCompiler: cache by canonical spec + tokenizer fingerprint, thread pool, time and size limits."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from grammar import GrammarCompiler, GrammarError, GrammarLimits, GrammarSpec
from tests.grammar.constrained_sampling import greedy_ids

SCHEMAS: dict[str, dict] = json.loads((Path(__file__).parent / "schemas.json").read_text())
SLOW_REGEX = r"(a|b)*a(a|b){10}"  # its DFA has ~2^11 states: ~40 ms to index with outlines-core


def test_cache_hit_is_fast_and_key_is_canonical(tokenizer_infos):
    compiler = GrammarCompiler(tokenizer_infos["byte_bpe"])
    schema = SCHEMAS["nested_object"]
    first = compiler.compile(GrammarSpec.json_schema(schema))
    reordered = json.dumps(dict(reversed(list(schema.items()))), indent=2)
    start = time.perf_counter()
    again = compiler.compile(GrammarSpec.json_schema(reordered))
    elapsed = time.perf_counter() - start
    assert again is first
    assert (compiler.cache_hits, compiler.cache_misses) == (1, 1)
    assert elapsed < 1e-3, f"cached compile took {elapsed * 1e3:.3f} ms"
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


def test_submit_does_not_block_and_dedupes_in_flight(tokenizer_infos):
    compiler = GrammarCompiler(tokenizer_infos["byte_bpe"], backend="outlines", timeout_s=30)
    start = time.perf_counter()
    first = compiler.submit(GrammarSpec.regex(SLOW_REGEX))
    second = compiler.submit(GrammarSpec.regex(SLOW_REGEX))
    assert time.perf_counter() - start < 0.02, "submit waited for the compile"
    assert second is first
    assert first.result(timeout=30).matcher() is not None
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
