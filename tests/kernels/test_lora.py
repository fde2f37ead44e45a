"""The CPU path of the LoRA ops (kernels.lora_cpu, through kernels.lora) against the torch reference twins."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from kernels import lora_cpu
from kernels.lora import (
    add_lora,
    add_lora_ref,
    lora_expand,
    lora_expand_ref,
    lora_shrink,
    lora_shrink_ref,
)
from kernels.lora_cpu import STRATEGIES, CpuRule, add_lora_cpu
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


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_base_rows_and_empty_slots_are_untouched(strategy, lora_weights) -> None:
    weights = lora_weights([[8, 8], [4, 0], [2, 2], [3, 0], [0, 0]], 24, (16, 8), max_rank=8)  # gate|up
    slots = [-1, 0, 4, -1, 3, 3, -1]
    meta = LoRABatchMeta.build(slots)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(len(slots), 24, generator=gen)
    x[[0, 3, 6]] = float("nan")  # base rows: whatever they hold must not reach y
    y = torch.randn(len(slots), 24, generator=gen)
    before = y.clone()
    add_lora_cpu(y, x, weights, meta, strategy)
    for t in (0, 2, 3, 6):  # slot -1, and slot 4 whose ranks are all 0
        assert torch.equal(y[t], before[t])
    assert not torch.equal(y[1], before[1])
    assert torch.equal(y[4, 16:], before[4, 16:])  # slot 3 does not adapt the "up" slice (rank 0)
    assert not torch.equal(y[4, :16], before[4, :16])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["decode", "prefill"])
@pytest.mark.parametrize("mix", MIXES)
def test_every_cpu_strategy_matches_reference(mix, layout, dtype, strategy, lora_batch, lora_weights) -> None:
    weights = lora_weights(MIXED_RANKS, 40, QKV, max_rank=8, dtype=dtype, seed=21)
    meta = LoRABatchMeta.build(lora_batch(mix, layout, weights.num_slots, seed=22))
    gen = torch.Generator().manual_seed(23)
    x = torch.randn(meta.num_tokens, 40, generator=gen).to(dtype)
    y = torch.randn(meta.num_tokens, sum(QKV), generator=gen).to(dtype)
    expected = y.clone()
    add_lora_ref(expected, x, weights, meta.token_slots)
    add_lora_cpu(y, x, weights, meta, strategy)
    if dtype == torch.float32:
        torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-5)
    else:  # bf16 matmuls round the shrunk activations and each slice's product: compare to the delta's scale
        scale = (expected.float() - y.float()).abs().max() / (expected.float().abs().max() + 1e-9)
        assert scale < 0.02, f"relative error {scale:.3g}"


def test_auto_mixes_strategies_within_one_batch(lora_weights) -> None:
    """A long prefill chunk (by slot, on views), a slot split over a chunk and scattered decode tokens
    (gathered), several single-token slots (packed, or stacked past packed_max_slots)."""
    weights = lora_weights([[8, 8, 8]] * 4 + [[4, 4, 4]] * 12 + [[8, 0, 2]] * 4, 40, QKV, max_rank=8, seed=24)
    slots = [0] * 40 + [1, 2, 3] + [1] * 10 + [-1, 2] + [1] * 3 + list(range(4, 20)) + [0, 3]
    meta = LoRABatchMeta.build(slots)
    gen = torch.Generator().manual_seed(25)
    x = torch.randn(len(slots), 40, generator=gen)
    for rule in (CpuRule(8, 8), CpuRule(8, 32), CpuRule(2, 4)):
        y = torch.randn(len(slots), sum(QKV), generator=gen)
        expected = y.clone()
        add_lora_ref(expected, x, weights, meta.token_slots)
        with _rules(rule):
            add_lora_cpu(y, x, weights, meta)
        torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-5)


def test_packs_are_dropped_when_a_slot_is_rewritten(lora_weights) -> None:
    weights = lora_weights([[8, 8, 8], [4, 4, 4], [2, 0, 2]], 40, QKV, max_rank=8, seed=26)
    meta = LoRABatchMeta.build([0, 1, 2, 1])
    gen = torch.Generator().manual_seed(27)
    x = torch.randn(4, 40, generator=gen)
    for strategy in ("packed", "stacked", "by_slot"):
        add_lora_cpu(torch.zeros(4, 64), x, weights, meta, strategy)  # fills the caches
    assert weights.cpu_cache
    weights.write_slot(1, [torch.randn(3, 40, generator=gen)] * 3, [torch.randn(n, 3, generator=gen) for n in QKV],
                       0.25)
    assert not weights.cpu_cache
    for strategy in ("packed", "stacked", "by_slot"):
        y, expected = torch.zeros(4, 64), torch.zeros(4, 64)
        add_lora_cpu(y, x, weights, meta, strategy)
        add_lora_ref(expected, x, weights, meta.token_slots)
        torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-5)
    weights.clear_slot(0)
    y = torch.zeros(4, 64)
    add_lora_cpu(y, x, weights, meta, "packed")
    assert not y[0].any()


def test_cpu_cache_never_outgrows_the_buffers(lora_weights) -> None:
    weights = lora_weights([[8, 8, 8]] * 6, 40, QKV, max_rank=8, seed=28)
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(29))
    for first in range(6):  # many distinct slot sets, each packed and stacked
        meta = LoRABatchMeta.build([(first + k) % 6 for k in range(6)][: 2 + first % 4])
        for strategy in ("packed", "stacked", "by_slot"):
            add_lora_cpu(torch.zeros(meta.num_tokens, 64), x[: meta.num_tokens], weights, meta, strategy)
        held = sum(v.a.nbytes + sum(b.nbytes for b in v.b_t if b is not None)
                   for k, v in weights.cpu_cache.items() if k[0] != "host")
        assert 0 < held <= weights.lora_a.nbytes + weights.lora_b.nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_shrink_and_expand_match_reference(dtype, lora_batch, lora_weights) -> None:
    weights = lora_weights(MIXED_RANKS, 40, QKV, max_rank=8, dtype=dtype, seed=4)
    meta = LoRABatchMeta.build(lora_batch("with_base", "prefill", weights.num_slots, seed=5))
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(meta.num_tokens, 40, generator=gen).to(dtype)
    buf = lora_shrink(x, weights, meta)
    assert buf.dtype == torch.float32
    torch.testing.assert_close(buf, lora_shrink_ref(x, weights, meta.token_slots), atol=1e-4, rtol=1e-5)
    buf = buf + torch.randn(buf.shape, generator=gen)  # expand must ignore columns past each slot's rank
    y = torch.randn(meta.num_tokens, sum(QKV), generator=gen).to(dtype)
    expected = y.clone()
    lora_expand_ref(expected, buf, weights, meta.token_slots)
    lora_expand(y, buf, weights, meta)
    # Both add the fp32 product to y in fp32 and round once into y's dtype: at most one ulp apart (the
    # fp32 sums differ only in order). 200 seeds peak at 0.92 of one ulp; allow two.
    ulp = {torch.float32: 1e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    torch.testing.assert_close(y.float(), expected.float(), atol=1e-4, rtol=2 * ulp)


def test_reference_formula_on_one_token(lora_weights) -> None:
    weights = lora_weights([[3, 2]], 8, (4, 5), max_rank=4, seed=6)
    x = torch.randn(1, 8, generator=torch.Generator().manual_seed(8))
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
    with pytest.raises(ValueError, match="strategy must be"):
        add_lora_cpu(torch.zeros(2, 8), torch.zeros(2, 8), weights, meta, "bogus")  # type: ignore[arg-type]


@contextmanager
def _rules(rule: CpuRule) -> Iterator[None]:
    saved = dict(lora_cpu.RULES)
    lora_cpu.RULES.update({key: rule for key in saved})
    try:
        yield
    finally:
        lora_cpu.RULES.update(saved)
