"""LoRABatchMeta: segments, active slots and CPU row groups from per-token slot ids."""

from __future__ import annotations

import pytest
import torch

from kernels.lora_meta import LoRABatchMeta


def test_segments_are_runs_of_equal_slots_in_token_order() -> None:
    meta = LoRABatchMeta.build([2, 2, -1, 0, 0, 0, 2, -1])
    assert meta.seg_starts.tolist() == [0, 2, 3, 6, 7, 8]
    assert meta.seg_slots.tolist() == [2, -1, 0, 2, -1]
    assert meta.active_slots == (0, 2)
    assert meta.max_segment_len == 3 and meta.num_segments == 5 and meta.num_tokens == 8
    rows = dict(meta.slot_rows)
    assert rows[0] == slice(3, 6)  # one segment: a slice, no gather
    assert rows[2].tolist() == [0, 1, 6]  # two segments: an index


def test_build_accepts_tensors_and_empty_batches() -> None:
    meta = LoRABatchMeta.build(torch.tensor([1, 1, 1], dtype=torch.int64))
    assert meta.token_slots.dtype == torch.int32 and meta.active_slots == (1,)
    assert dict(meta.slot_rows)[1] == slice(0, 3)
    empty = LoRABatchMeta.build([])
    assert empty.num_tokens == 0 and empty.active_slots == () and empty.seg_starts.tolist() == [0]


def test_build_rejects_bad_slots() -> None:
    with pytest.raises(ValueError, match=">= -1"):
        LoRABatchMeta.build([0, -2])
    with pytest.raises(ValueError, match="integers"):
        LoRABatchMeta.build(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="1-D"):
        LoRABatchMeta.build(torch.zeros(2, 2, dtype=torch.int32))


def test_meta_is_frozen_and_validated() -> None:
    meta = LoRABatchMeta.build([0])
    with pytest.raises(AttributeError):
        meta.max_segment_len = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="seg_starts has"):
        LoRABatchMeta(meta.token_slots, meta.seg_starts[:1], meta.seg_slots, (0,), 1, ())
