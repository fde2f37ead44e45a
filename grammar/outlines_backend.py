"""outlines-core backend: JSON schema → regex → DFA → token index over the vocabulary.

Compiles eagerly (the whole token-level index is built up front, 10-100x slower than llguidance
here), then each mask is a table look-up. A regular language cannot count or recurse, so this
backend refuses what its regex translation ignores (found by sampling, see tests/grammar):
numeric ranges, multipleOf, uniqueItems, patternProperties, property counts, recursive $ref.
"""

from __future__ import annotations

import outlines_core
import torch
from outlines_core.json_schema import build_regex_from_schema

from grammar.backend import MAX_ROLLBACK, CompiledGrammar, GrammarBackend, GrammarLimits, GrammarMatcher
from grammar.spec import BackendRefusal, GrammarError, GrammarSpec, canonical_json
from grammar.tokenizer_info import TokenizerInfo


class OutlinesMatcher(GrammarMatcher):
    def __init__(self, index: outlines_core.Index, grammar: OutlinesGrammar) -> None:
        self._guide = outlines_core.Guide(index, max_rollback=MAX_ROLLBACK)
        self._eos = grammar.backend.tokenizer_info.eos_token_ids
        self.backend = grammar.backend
        self.grammar = grammar
        self._terminated = False

    def accept_token(self, token_id: int) -> bool:
        if self._terminated:
            return False
        if token_id in self._eos:
            self._terminated = self._guide.is_finished()
            return self._terminated
        try:
            self._guide.advance(token_id, return_tokens=False)
        except ValueError:  # no transition: the state is unchanged
            return False
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._terminated:  # the EOS that terminated it never entered the guide
            self._terminated = False
            num_tokens -= 1
        if num_tokens:
            self._guide.rollback_state(num_tokens)

    def is_accepting(self) -> bool:
        return self._terminated or self._guide.is_finished()

    def is_terminated(self) -> bool:
        if self._terminated:
            return True
        if not self._guide.is_finished():
            return False
        return all(token in self._eos for token in self._guide.get_tokens())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        if self._terminated:
            target.zero_()
        else:
            self._guide.write_mask_into(target.data_ptr(), target.numel(), target.element_size())
        if self.is_accepting():
            for eos in self._eos:
                target[eos // 32] |= _bit(eos % 32)


def _bit(position: int) -> int:
    """int32 value with only bit `position` set (bit 31 is the sign bit)."""
    return -(1 << 31) if position == 31 else 1 << position


class OutlinesGrammar(CompiledGrammar):
    backend: OutlinesBackend

    def __init__(self, spec: GrammarSpec, backend: OutlinesBackend, index: outlines_core.Index) -> None:
        self.spec = spec
        self.backend = backend
        self._index = index

    def matcher(self) -> OutlinesMatcher:
        return OutlinesMatcher(self._index, self)


class OutlinesBackend(GrammarBackend):
    name = "outlines"
    unsupported_keywords = frozenset(
        {
            "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
            "uniqueItems", "patternProperties", "minProperties", "maxProperties",
            "propertyNames", "not", "contains", "if", "then", "else", "dependentRequired",
            "dependentSchemas", "unevaluatedProperties", "unevaluatedItems", "allOf", "oneOf",
        }
    )
    # Only formats whose regex was verified exact by sampling: outlines' date pattern uses \d,
    # which matches any Unicode digit ("２߄🯵3-02-14"), and allows 2024-02-31; its email pattern
    # never finished within 120 tokens in sampling, so it is unverified.
    supported_formats = frozenset({"uuid"})
    supports_recursive_ref = False

    def __init__(self, tokenizer_info: TokenizerInfo, limits: GrammarLimits) -> None:
        super().__init__(tokenizer_info, limits)
        by_bytes: dict[bytes, list[int]] = {}
        for token_id, b in enumerate(tokenizer_info.token_bytes):
            if b:
                by_bytes.setdefault(b, []).append(token_id)
        self._vocabulary = outlines_core.Vocabulary(tokenizer_info.eos_token_ids[0], by_bytes)

    def compile(self, spec: GrammarSpec, schema: dict | None = None) -> OutlinesGrammar:
        try:
            if spec.kind in ("json_schema", "json_object"):
                regex = build_regex_from_schema(spec.value if schema is None else canonical_json(schema))
            else:
                regex = spec.as_regex()
            index = outlines_core.Index(regex, self._vocabulary)
        except (ValueError, TypeError, RuntimeError) as e:
            raise BackendRefusal(spec.kind, "outlines-core", str(e)) from None
        states = len(index.get_transitions())
        if states > self.limits.max_states:
            raise GrammarError(
                f"{spec.kind} is too large: its automaton has {states} states (limit {self.limits.max_states})"
            )
        return OutlinesGrammar(spec, self, index)
