"""A decode loop without a model: seeded random logits over a vocabulary padded to a multiple of 64
(like a model's lm_head), masked by the grammar, sampled at temperature 1.0; and output checks."""

from __future__ import annotations

import datetime
import re

import jsonschema
import torch
from tokenizers import Tokenizer

from grammar import CompiledGrammar, TokenizerInfo, allocate_bitmask, apply_bitmask, fill_bitmasks

KINDS = ("byte_bpe", "sentencepiece")


def padded(vocab_size: int) -> int:
    return (vocab_size + 63) // 64 * 64 + 64


def sample_constrained(compiled: CompiledGrammar, info: TokenizerInfo, seed: int,
                       max_tokens: int = 160) -> tuple[list[int], str]:
    """Token ids (without EOS) and "stop" | "length" for one seeded temperature-1.0 sample."""
    matcher = compiled.matcher()
    bitmask = allocate_bitmask(1, info.vocab_size)
    generator = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for _ in range(max_tokens):
        fill_bitmasks([matcher], bitmask)
        logits = torch.randn(1, padded(info.vocab_size), generator=generator)  # (1, V_padded)
        apply_bitmask(logits, bitmask, [0])
        token = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        assert token < info.vocab_size, f"padded id {token} was sampled"
        assert token not in info.special_token_ids or token in info.eos_token_ids, f"special {token}"
        assert matcher.accept_token(token), f"matcher refused its own allowed token {token}"
        if token in info.eos_token_ids:
            return ids, "stop"
        ids.append(token)
        if matcher.is_terminated():
            return ids, "stop"
    return ids, "length"



def decode(tokenizer: Tokenizer, info: TokenizerInfo, ids: list[int]) -> str:
    """Decode with the tokenizer and check it agrees with TokenizerInfo's bytes.

    The SentencePiece decoder strips one leading space ("▁" of the first word), nothing else.
    """
    text = tokenizer.decode(ids, skip_special_tokens=False)
    raw = b"".join(info.token_bytes[i] or b"" for i in ids).decode("utf-8")
    expected = raw[1:] if info.kind == "sentencepiece" and raw.startswith(" ") else raw
    assert text == expected, (text, raw)
    return text


_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$", re.ASCII)


def validate(value, schema: dict) -> None:
    jsonschema.validate(value, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    if schema.get("format") == "date-time":  # jsonschema skips date-time without rfc3339-validator
        assert _RFC3339.match(value), value
        leap_second_as_59 = value[:17] + "59" + value[19:] if value[17:19] == "60" else value  # RFC 3339 allows :60
        datetime.datetime.fromisoformat(leap_second_as_59.upper())


def greedy_ids(info: TokenizerInfo, text: str) -> list[int]:
    """Some token split of `text` (longest byte match first): the grammar must accept any split."""
    table: dict[bytes, int] = {}
    for token_id, piece in enumerate(info.token_bytes):
        if piece:
            table.setdefault(piece, token_id)
    longest = max(len(p) for p in table)
    data, ids, pos = text.encode(), [], 0
    while pos < len(data):
        for length in range(min(longest, len(data) - pos), 0, -1):
            if data[pos : pos + length] in table:
                ids.append(table[data[pos : pos + length]])
                pos += length
                break
        else:
            raise AssertionError(f"no token covers byte {data[pos]} of {text!r}")
    return ids


def accepts(compiled: CompiledGrammar, info: TokenizerInfo, text: str) -> bool:
    """The grammar takes `text` token by token and may end there (EOS allowed)."""
    matcher = compiled.matcher()
    return all(matcher.accept_token(t) for t in greedy_ids(info, text)) and matcher.is_accepting()


def accepts_in_some_order(compiled: CompiledGrammar, info: TokenizerInfo, instance, budget: int = 20_000) -> bool:
    """The grammar takes `instance` serialized compactly with its object keys in some order (a grammar
    fixes one order of properties; which one follows from how the backend merged the schema). Depth-first
    over key orders, pruned by feeding each prefix to a fresh matcher."""
    import json

    calls = [0]

    def feasible(text: str) -> bool:
        calls[0] += 1
        if calls[0] > budget:
            raise AssertionError(f"key-order search over budget for {instance!r}")
        matcher = compiled.matcher()
        return all(matcher.accept_token(t) for t in greedy_ids(info, text))

    def emit(prefix: str, value, then) -> bool:
        if isinstance(value, dict):
            return members(prefix + "{", list(value.items()), True, then)
        if isinstance(value, list):
            return elements(prefix + "[", value, True, then)
        text = prefix + json.dumps(value, ensure_ascii=False)
        return feasible(text) and then(text)

    def members(prefix: str, remaining: list, first: bool, then) -> bool:
        if not remaining:
            return feasible(prefix + "}") and then(prefix + "}")
        for i, (key, value) in enumerate(remaining):
            head = prefix + ("" if first else ",") + json.dumps(key, ensure_ascii=False) + ":"
            rest = remaining[:i] + remaining[i + 1:]
            if feasible(head) and emit(head, value, lambda text, rest=rest: members(text, rest, False, then)):
                return True
        return False

    def elements(prefix: str, remaining: list, first: bool, then) -> bool:
        if not remaining:
            return feasible(prefix + "]") and then(prefix + "]")
        head = prefix + ("" if first else ",")
        return emit(head, remaining[0], lambda text: elements(text, remaining[1:], False, then))

    return emit("", instance, lambda text: accepts(compiled, info, text))
