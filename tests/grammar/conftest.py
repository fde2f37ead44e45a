"""Grammar fixtures: TokenizerInfo and compilers per tokenizer kind, and a constrained sampler.

The sampler stands in for the engine's decode loop without a model: seeded random logits over a
vocabulary padded to a multiple of 64 (like a model's lm_head), masked by the grammar, sampled at
temperature 1.0.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from grammar import (
    CompiledGrammar,
    GrammarCompiler,
    TokenizerInfo,
    allocate_bitmask,
    apply_bitmask,
    fill_bitmasks,
)

KINDS = ("byte_bpe", "sentencepiece")


@pytest.fixture(scope="session")
def tokenizer_infos(tokenizer_dirs: dict[str, Path]) -> dict[str, TokenizerInfo]:
    return {kind: TokenizerInfo.from_file(tokenizer_dirs[kind]) for kind in KINDS}


@pytest.fixture(scope="session")
def tokenizers(tokenizer_dirs: dict[str, Path]) -> dict[str, Tokenizer]:
    return {kind: Tokenizer.from_file(str(tokenizer_dirs[kind] / "tokenizer.json")) for kind in KINDS}


@pytest.fixture(scope="session")
def compilers(tokenizer_infos: dict[str, TokenizerInfo]):
    """{(kind, backend): GrammarCompiler}, built lazily and shut down at the end."""
    made: dict[tuple[str, str], GrammarCompiler] = {}

    def get(kind: str, backend: str = "llguidance") -> GrammarCompiler:
        if (kind, backend) not in made:
            made[(kind, backend)] = GrammarCompiler(tokenizer_infos[kind], backend=backend, timeout_s=30)
        return made[(kind, backend)]

    yield get
    for compiler in made.values():
        compiler.shutdown()


def padded(vocab_size: int) -> int:
    return (vocab_size + 63) // 64 * 64 + 64


@pytest.fixture(scope="session")
def sample() -> Callable[..., tuple[list[int], str]]:
    """sample(compiled, info, seed, max_tokens) -> (token ids without EOS, "stop" | "length")."""

    def run(compiled: CompiledGrammar, info: TokenizerInfo, seed: int, max_tokens: int = 160):
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

    return run


def decode(tokenizer: Tokenizer, info: TokenizerInfo, ids: list[int]) -> str:
    """Decode with the tokenizer and check it agrees with TokenizerInfo's bytes.

    The SentencePiece decoder strips one leading space ("▁" of the first word), nothing else.
    """
    text = tokenizer.decode(ids, skip_special_tokens=False)
    raw = b"".join(info.token_bytes[i] or b"" for i in ids).decode("utf-8")
    expected = raw[1:] if info.kind == "sentencepiece" and raw.startswith(" ") else raw
    assert text == expected, (text, raw)
    return text
