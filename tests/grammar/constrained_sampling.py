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
