"""LoRAStackedWeights: slot layout, write/clear, validation."""

from __future__ import annotations

import pytest
import torch

from kernels.lora_weights import LoRAStackedWeights


def test_write_slot_places_slices_and_pads_with_zeros() -> None:
    weights = LoRAStackedWeights.allocate(2, 4, 6, (5, 3, 3))
    a_q, b_q = torch.randn(2, 6), torch.randn(5, 2)
    a_v, b_v = torch.randn(4, 6), torch.randn(3, 4)
    weights.write_slot(1, [a_q, None, a_v], [b_q, None, b_v], [0.5, 0.0, 2.0])
    assert weights.slice_offsets == (0, 5, 8) and weights.out_features == 11
    assert weights.ranks.tolist() == [[0, 0, 0], [2, 0, 4]]
    assert weights.scaling[1].tolist() == [0.5, 0.0, 2.0]
    assert torch.equal(weights.lora_a[1, :2], a_q) and torch.equal(weights.lora_a[1, 8:], a_v)
    assert torch.equal(weights.lora_b[1, :5, :2], b_q) and torch.equal(weights.lora_b[1, 8:], b_v)
    assert not weights.lora_a[1, 2:8].any() and not weights.lora_b[1, :5, 2:].any()
    assert not weights.lora_a[0].any()
    weights.clear_slot(1)
    assert not weights.lora_a.any() and not weights.ranks.any()


def test_write_slot_rejects_bad_adapters() -> None:
    weights = LoRAStackedWeights.allocate(1, 4, 6, (5,))
    with pytest.raises(ValueError, match="rank 8 is outside"):
        weights.write_slot(0, [torch.randn(8, 6)], [torch.randn(5, 8)], 1.0)
    with pytest.raises(ValueError, match="do not fit"):
        weights.write_slot(0, [torch.randn(2, 7)], [torch.randn(5, 2)], 1.0)
    with pytest.raises(ValueError, match="both be given"):
        weights.write_slot(0, [torch.randn(2, 6)], [None], 1.0)
    with pytest.raises(ValueError, match="slot 1 is outside"):
        weights.clear_slot(1)


def test_construction_is_validated() -> None:
    good = LoRAStackedWeights.allocate(2, 4, 6, (5, 3))
    with pytest.raises(ValueError, match="lora_b has shape"):
        LoRAStackedWeights(good.lora_a, good.lora_b[:, :7], good.scaling, good.ranks, good.slice_sizes)
    with pytest.raises(ValueError, match="ranks must be"):
        LoRAStackedWeights(good.lora_a, good.lora_b, good.scaling, good.ranks.long(), good.slice_sizes)
    with pytest.raises(ValueError, match="slice_sizes"):
        LoRAStackedWeights.allocate(2, 4, 6, ())
