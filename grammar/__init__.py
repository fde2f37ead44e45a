"""Structured output: compile a JSON schema, any JSON object, a regex or a choice list into a
token-level automaton over the model's vocabulary, and mask logits with it.

Engine use, per constrained request and step:

    compiler = GrammarCompiler(TokenizerInfo.from_file(model_dir))     # once per worker
    future = compiler.submit(GrammarSpec.json_schema(schema))          # at admission; GrammarError if refused
    matcher = future.result().matcher()                                # once future.done()
    bitmask = allocate_bitmask(max_batch, info.vocab_size)             # once
    fill_bitmasks(matchers, bitmask)                                   # each step, one call
    apply_bitmask(logits, bitmask, rows)                               # before sampling
    matcher.accept_token(sampled_id); matcher.is_terminated()          # after sampling -> "stop"
    matcher.grammar.guard.check(text)                                  # the finished output: None if valid
"""

from grammar.backend import CompiledGrammar, GrammarBackend, GrammarLimits, GrammarMatcher
from grammar.bitmask import allocate_bitmask, apply_bitmask, bitmask_words, fill_bitmasks
from grammar.compiler import BACKENDS, DEFAULT_BACKEND, CompileStats, GrammarCompiler
from grammar.guard import OutputGuard
from grammar.normalize import NormalizedSchema, NormalizeReport, normalize_schema
from grammar.spec import GrammarError, GrammarSpec
from grammar.tokenizer_info import TokenizerInfo

__all__ = [
    "BACKENDS", "DEFAULT_BACKEND", "CompileStats", "CompiledGrammar", "GrammarBackend", "GrammarCompiler",
    "GrammarError", "GrammarLimits", "GrammarMatcher", "GrammarSpec", "NormalizeReport", "NormalizedSchema",
    "OutputGuard", "TokenizerInfo", "allocate_bitmask", "apply_bitmask", "bitmask_words", "fill_bitmasks",
    "normalize_schema",
]
