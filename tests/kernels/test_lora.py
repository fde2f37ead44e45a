"""The grouped CPU path of the LoRA ops against the per-token torch reference twins."""

from __future__ import annotations

import pytest
import torch

from kernels.lora import (
    add_lora,
    add_lora_ref,
    lora_expand,
    lora_expand_ref,
    lora_shrink,
    lora_shrink_ref,
)
from kernels.lora_meta import LoRABatchMeta

MIXES = ["distinct", "uniform", "skewed", "identical", "with_base"]
QKV = (32, 16, 16)  # fused q|k|v output slices
MIXED_RANKS = [[8, 8, 8], [4, 0, 4], [2, 2, 2], [1, 8, 0], [0, 0, 0], [8, 4, 2]]  # slot 4 holds nothing


@pytest.mark.parametrize("layout", ["decode", "prefill"])
@pytest.mark.parametrize("mix", MIXES)
def test_add_lora_matches_reference(mix, layout, lora_batch, lora_weights) -> None:
    weights = lora_weights(MIXED_RANKS, 40, QKV, max_rank=8, seed=1)
    meta = LoRABatchMeta.build(lora_batch(mix, layout, weights.num_slots, seed=2))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(meta.num_tokens, 40, generator=gen)
    y = torch.randn(meta.num_tokens, sum(QKV), generator=gen)
    expected = y.clone()
    add_lora_ref(expected, x, weights, meta.token_slots)
    add_lora(y, x, weights, meta)
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-5)


def test_base_rows_and_empty_slots_are_untouched(lora_weights) -> None:
    weights = lora_weights([[8, 8], [4, 0], [2, 2], [3, 0], [0, 0]], 24, (16, 8), max_rank=8)  # gate|up
    slots = [-1, 0, 4, -1, 3, 3, -1]
    meta = LoRABatchMeta.build(slots)
    x = torch.randn(len(slots), 24)
    y = torch.randn(len(slots), 24)
    before = y.clone()
    add_lora(y, x, weights, meta)
    for t in (0, 2, 3, 6):  # slot -1, and slot 4 whose ranks are all 0
        assert torch.equal(y[t], before[t])
    assert not torch.equal(y[1], before[1])
    assert torch.equal(y[4, 16:], before[4, 16:])  # slot 3 does not adapt the "up" slice (rank 0)
    assert not torch.equal(y[4, :16], before[4, :16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_shrink_and_expand_match_reference(dtype, lora_batch, lora_weights) -> None:
    weights = lora_weights(MIXED_RANKS, 40, QKV, max_rank=8, dtype=dtype, seed=4)
    meta = LoRABatchMeta.build(lora_batch("with_base", "prefill", weights.num_slots, seed=5))
    x = torch.randn(meta.num_tokens, 40).to(dtype)
    buf = lora_shrink(x, weights, meta)
    assert buf.dtype == torch.float32
    torch.testing.assert_close(buf, lora_shrink_ref(x, weights, meta.token_slots), atol=1e-4, rtol=1e-5)
    buf = buf + torch.randn(buf.shape)  # expand must ignore columns past each slot's rank
    y = torch.randn(meta.num_tokens, sum(QKV)).to(dtype)
    expected = y.clone()
    lora_expand_ref(expected, buf, weights, meta.token_slots)
    lora_expand(y, buf, weights, meta)
    tol = 1e-4 if dtype == torch.float32 else 0.1  # both round the fp32 sum once into y's dtype
    torch.testing.assert_close(y.float(), expected.float(), atol=tol, rtol=1e-2)


def test_reference_formula_on_one_token(lora_weights) -> None:
    weights = lora_weights([[3, 2]], 8, (4, 5), max_rank=4, seed=6)
    x = torch.randn(1, 8)
    y = torch.zeros(1, 9)
    add_lora_ref(y, x, weights, torch.tensor([0]))
    a_q, a_k = weights.lora_a[0, :3], weights.lora_a[0, 4:6]
    b_q, b_k = weights.lora_b[0, :4, :3], weights.lora_b[0, 4:, :2]
    expected = torch.cat([0.5 * x @ a_q.T @ b_q.T, 1.5 * x @ a_k.T @ b_k.T], dim=1)
    torch.testing.assert_close(y, expected)


def test_ops_reject_mismatched_operands(lora_weights) -> None:
    weights = lora_weights([[2, 2]], 8, (4, 4), max_rank=2)
    meta = LoRABatchMeta.build([0, 0])
    with pytest.raises(ValueError, match="x has shape"):
        add_lora(torch.zeros(2, 8), torch.zeros(2, 7), weights, meta)
    with pytest.raises(ValueError, match="y is torch.float16"):
        add_lora(torch.zeros(2, 8, dtype=torch.float16), torch.zeros(2, 8), weights, meta)
    with pytest.raises(ValueError, match="outside the 1 slots"):
        add_lora(torch.zeros(2, 8), torch.zeros(2, 8), weights, LoRABatchMeta.build([1, 0]))
    with pytest.raises(ValueError, match="mode must be"):
        lora_shrink(torch.zeros(2, 8), weights, meta, mode="bogus")  # type: ignore[arg-type]
