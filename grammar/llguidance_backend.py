"""llguidance backend: JSON schema / regex → Earley parser over a lazily built lexer, masks in Rust.

Why it is the default: on this machine it compiles the test schemas ~50-100x faster than
outlines-core (see bench/grammar.py), fills a batch of masks in parallel without the GIL, and
enforces more of JSON Schema (integer and number ranges, minItems/maxItems, $ref recursion,
anyOf, formats); it errors on keywords it does not implement instead of ignoring them.

The vocabulary is handed over as TokenizerInfo's true bytes (special tokens as b"\\xff" + name, the
marker llguidance uses for special tokens), not as tokenizer.json, because llguidance's own
tokenizer.json reader takes SentencePiece `<0xNN>` byte tokens for special tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch

from grammar.backend import CompiledGrammar, GrammarBackend, GrammarLimits, GrammarMatcher
from grammar.spec import BackendRefusal, GrammarSpec, canonical_json
from grammar.tokenizer_info import TokenizerInfo
from grammar.tool_calls import tool_calls_lark

_SPECIAL_MARKER = b"\xff"

# Compact JSON (no free whitespace): a sampled object cannot wander off into endless blanks.
_JSON_OPTIONS = {"whitespace_flexible": False, "lenient": False, "coerce_one_of": False}


class _ByteVocabulary:
    """The tokenizer object llguidance.TokenizerWrapper reads: token bytes plus a tokenize function.

    Tokenizing is greedy longest match over the vocabulary's bytes. llguidance only uses it to
    turn forced bytes into tokens, so it must reproduce the bytes exactly; it need not be the
    tokenizer's canonical split (the HF tokenizer would add SentencePiece's leading "▁").
    """

    def __init__(self, info: TokenizerInfo) -> None:
        self.eos_token_id = info.eos_token_ids[0]
        self.bos_token_id = None
        self.special_token_ids = sorted(info.special_token_ids)
        self.tokens = [
            _SPECIAL_MARKER + b"<special_%d>" % i if b is None else b for i, b in enumerate(info.token_bytes)
        ]
        self._ids: dict[bytes, int] = {}
        for token_id, b in enumerate(info.token_bytes):
            if b:
                self._ids.setdefault(b, token_id)
        self._longest = max((len(b) for b in self._ids), default=1)

    def __call__(self, text: bytes) -> list[int]:
        ids, pos = [], 0
        while pos < len(text):
            for length in range(min(self._longest, len(text) - pos), 0, -1):
                token_id = self._ids.get(text[pos : pos + length])
                if token_id is not None:
                    ids.append(token_id)
                    pos += length
                    break
            else:  # a byte no token covers: it cannot be forced, skip it
                pos += 1
        return ids


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: llguidance.LLMatcher, grammar: LLGuidanceGrammar) -> None:
        self._matcher = matcher
        self.backend = grammar.backend
        self.grammar = grammar

    def accept_token(self, token_id: int) -> bool:
        # validate first: consuming a disallowed token would put the matcher in a permanent error state
        if self._matcher.is_stopped() or self._matcher.validate_tokens([token_id]) != 1:
            self._check_lexer()
            return False
        if not self._matcher.consume_token(token_id):
            self._check_lexer()
            return False
        return True

    def _check_lexer(self) -> None:
        """A refusal that is llguidance's own failure (its shared lexer out of fuel or states) marks the
        grammar broken, so that no later request gets its matchers."""
        if self.grammar.broken is None and self._matcher.is_error() and "lexer error" in self._matcher.get_error():
            self.grammar.broken = self._matcher.get_error()

    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._matcher.get_error()}")

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def error(self) -> str:
        """llguidance's error message, empty while the matcher is healthy."""
        return self._matcher.get_error()


class LLGuidanceGrammar(CompiledGrammar):
    backend: LLGuidanceBackend

    def __init__(self, spec: GrammarSpec, backend: LLGuidanceBackend, template: llguidance.LLMatcher) -> None:
        self.spec = spec
        self.backend = backend
        self._template = template

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template.deep_copy(), self)


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"
    # Sampling found no keyword that llguidance 1.9 accepts without enforcing (ranges, multipleOf,
    # min/maxItems, patternProperties, allOf, disjoint oneOf all hold). These it refuses itself, without
    # a path; listing them makes the strictness check name the JSON pointer instead.
    unsupported_keywords = frozenset(
        {"uniqueItems", "propertyNames", "not", "contains", "if", "then", "else", "dependentRequired",
         "dependentSchemas", "unevaluatedProperties", "unevaluatedItems"}
    )
    supported_formats = frozenset(
        {"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"}
    )
    # Sampling found "2431-11-30t12:29:60z": a leap second outside 23:59 UTC, which RFC 3339 checkers refuse;
    # and a hostname of four 63-byte labels (255 bytes): llguidance bounds the labels, not the 253-byte total.
    approximate_formats = frozenset({"date-time", "time", "hostname"})
    supports_recursive_ref = True

    def __init__(self, tokenizer_info: TokenizerInfo, limits: GrammarLimits) -> None:
        super().__init__(tokenizer_info, limits)
        self._tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer_info)),
            n_vocab=tokenizer_info.vocab_size,
            eos_token=list(tokenizer_info.eos_token_ids),
        )
        self._executor = llguidance.LLExecutor()

    def _parser_limits(self) -> llguidance.LLParserLimits:
        return llguidance.LLParserLimits(
            max_lexer_states=self.limits.max_states,
            max_grammar_size=self.limits.max_grammar_symbols,
            step_lexer_fuel=self.limits.step_lexer_fuel,
            verbose_errors=False,
        )

    def compile(self, spec: GrammarSpec, schema: dict | None = None) -> LLGuidanceGrammar:
        if spec.kind in ("json_schema", "json_object"):
            text = spec.value if schema is None else canonical_json(schema)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=_JSON_OPTIONS)  # type: ignore[arg-type]
        elif spec.kind == "tool_calls":
            grammar = llguidance.LLMatcher.grammar_from_lark(tool_calls_lark(spec, schema))
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(spec.as_regex())
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._parser_limits())
        if template.is_error():
            raise BackendRefusal(spec.kind, self.name, self._with_limit(template.get_error()))
        # warnings mean something was approximated: strict mode refuses them
        if template.get_grammar_warnings():
            raise BackendRefusal(spec.kind, self.name, "; ".join(template.get_grammar_warnings()))
        return LLGuidanceGrammar(spec, self, template)

    def too_large(self, schema: dict) -> bool:
        # llguidance builds at most 50,000 schema nodes (a fixed limit of its JSON compiler, not a parser
        # limit); the check stops there, so it costs a fraction of a compile.
        grammar = llguidance.LLMatcher.grammar_from_json_schema(canonical_json(schema), overrides=_JSON_OPTIONS)  # type: ignore[arg-type]
        return "schema too large" in llguidance.LLMatcher.validate_grammar(grammar)

    def _with_limit(self, error: str) -> str:
        """llguidance's error, naming the GrammarLimits field where it is over one of ours."""
        if error.startswith("schema too large"):
            return f"{error}: over the llguidance JSON compiler's fixed limit of 50000 schema nodes built " \
                   "(allOf of anyOf branches multiply out)"
        if "grammar size" in error:
            return f"{error} (GrammarLimits.max_grammar_symbols = {self.limits.max_grammar_symbols})"
        if "lexer" in error and "states" in error:
            return f"{error} (GrammarLimits.max_states = {self.limits.max_states})"
        return error

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor,
                      rows: Sequence[int]) -> None:
        # NOTE: llguidance.torch is not imported: it pulls in torch.compile at import time.
        pairs = [(m._matcher, row) for m, row in zip(matchers, rows, strict=True)]  # type: ignore[attr-defined]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
