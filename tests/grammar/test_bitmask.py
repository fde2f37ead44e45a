"""Bitmask layout, batched fills across backends, and apply_bitmask against its reference loop."""

from __future__ import annotations

import pytest
import torch

from grammar import GrammarSpec, allocate_bitmask, apply_bitmask, bitmask_words, fill_bitmasks


def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    words = bitmask.shape[1]
    for j, r in enumerate(rows):
        for t in range(logits.shape[1]):
            allowed = t < 32 * words and (int(bitmask[j, t // 32]) >> (t % 32)) & 1
            if not allowed:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [2, 0], [3]])
def test_apply_matches_reference_with_padded_vocab(rows):
    generator = torch.Generator().manual_seed(0)
    vocab, padded = 70, 128  # the model pads its logits beyond the tokenizer's vocabulary
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, bitmask_words(vocab)), dtype=torch.int32, generator=generator)
    logits = torch.randn(4, padded, generator=generator)
    expected = reference_apply(logits, bitmask, rows)
    apply_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[rows, 96:]).all(), "ids past the bitmask are always masked"
    untouched = [r for r in range(4) if r not in rows]
    assert torch.isfinite(logits[untouched]).all()


def test_fill_bitmasks_batches_rows_across_backends(compilers, tokenizer_infos):
    info = tokenizer_infos["byte_bpe"]
    digits = [compilers("byte_bpe", b).compile(GrammarSpec.regex("[0-9]+")).matcher() for b in ("llguidance", "outlines")]
    letters = compilers("byte_bpe").compile(GrammarSpec.regex("[a-z]")).matcher()
    bitmask = allocate_bitmask(5, info.vocab_size)
    fill_bitmasks([digits[0], letters, digits[1]], bitmask, rows=[4, 0, 2])
    logits = torch.zeros(5, info.vocab_size + 64)
    apply_bitmask(logits, bitmask[[4, 0, 2]].contiguous(), [4, 0, 2])
    for row, pattern in ((4, b"0123456789"), (0, b"abcdefghijklmnopqrstuvwxyz"), (2, b"0123456789")):
        allowed = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert allowed, row
        for token in allowed:
            token_bytes = info.token_bytes[token]
            assert token_bytes and all(byte in pattern for byte in token_bytes), (row, token_bytes)
    assert torch.equal(logits[1], torch.zeros(info.vocab_size + 64)), "rows not passed are untouched"
    # the two backends agree on the same grammar
    assert torch.equal(bitmask[4], bitmask[2])


def test_fill_rejects_bad_bitmask(compilers):
    matcher = compilers("byte_bpe").compile(GrammarSpec.regex("a")).matcher()
    with pytest.raises(ValueError, match="int32"):
        fill_bitmasks([matcher], torch.zeros(1, 30, dtype=torch.int64))
    with pytest.raises(ValueError, match="rows"):
        fill_bitmasks([matcher], allocate_bitmask(1, 900), rows=[3])
