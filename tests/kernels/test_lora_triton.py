"""Triton LoRA kernels against the torch reference twins (interpreted on CPU here, compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from triton import knobs  # noqa: E402

from kernels import lora_triton  # noqa: E402
from kernels.lora import add_lora, add_lora_ref, lora_expand_ref, lora_shrink_ref  # noqa: E402
from kernels.lora_meta import LoRABatchMeta  # noqa: E402

MIXES = ["distinct", "uniform", "skewed", "identical", "with_base"]
QKV = (32, 16, 16)
MIXED_RANKS = [[8, 8, 8], [4, 0, 4], [2, 2, 2], [1, 8, 0], [0, 0, 0], [8, 4, 2]]


def test_kernels_are_interpreted_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the kernels are compiled")
    from triton.runtime.interpreter import InterpretedFunction

    assert knobs.runtime.interpret
    assert isinstance(lora_triton._shrink_kernel, InterpretedFunction)
    assert isinstance(lora_triton._expand_kernel, InterpretedFunction)


@pytest.mark.parametrize("segments", [False, True], ids=["tokens", "segments"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("mix", MIXES)
def test_add_lora_matches_reference(mix, dtype, segments, lora_batch, lora_weights, triton_device) -> None:
    weights = lora_weights(MIXED_RANKS, 40, QKV, max_rank=8, dtype=dtype, seed=11)
    slots = lora_batch(mix, "prefill" if segments else "decode", weights.num_slots, seed=12)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(len(slots), 40, generator=gen).to(dtype)
    y = torch.randn(len(slots), sum(QKV), generator=gen).to(dtype)
    expected = y.clone()
    add_lora_ref(expected, x, weights, torch.tensor(slots))

    weights_dev = _to(weights, triton_device)
    meta = LoRABatchMeta.build(slots, device=triton_device)
    y_dev = y.to(triton_device)
    buf = lora_triton.shrink(x.to(triton_device), weights_dev, meta, segments)
    torch.testing.assert_close(buf.cpu(), lora_shrink_ref(x, weights, meta.token_slots.cpu()), atol=1e-3, rtol=1e-4)
    lora_triton.expand(y_dev, buf, weights_dev, meta, segments)
    tol = 1e-4 if dtype == torch.float32 else 0.1  # fp16 y: both round one fp32 sum of magnitude ~100
    torch.testing.assert_close(y_dev.cpu().float(), expected.float(), atol=tol, rtol=1e-2)
    base = [t for t, s in enumerate(slots) if s == -1 or s == 4]
    assert torch.equal(y_dev.cpu()[base], y[base])  # slot -1 and the empty slot 4 leave rows untouched

    # expand alone must ignore buf columns past each slot's rank, whatever they hold
    noisy_buf = torch.randn(buf.shape, generator=gen)
    expected = y.clone()
    lora_expand_ref(expected, noisy_buf, weights, torch.tensor(slots))
    y_dev = y.to(triton_device)
    lora_triton.expand(y_dev, noisy_buf.to(triton_device), weights_dev, meta, segments)
    torch.testing.assert_close(y_dev.cpu().float(), expected.float(), atol=tol, rtol=1e-2)


@pytest.mark.parametrize("segments", [False, True], ids=["tokens", "segments"])
def test_segments_of_one_slot_split_by_other_slots(segments, lora_weights, triton_device) -> None:
    weights = lora_weights([[16], [3], [16]], 72, (80,), max_rank=16, seed=14)  # n > BLOCK_N, K > BLOCK_K
    slots = [0] * 20 + [1] * 3 + [-1] * 2 + [0] * 17 + [2]  # slot 0 owns two segments, one longer than a tile
    x = torch.randn(len(slots), 72)
    y = torch.randn(len(slots), 80)
    expected = y.clone()
    add_lora_ref(expected, x, weights, torch.tensor(slots))
    y_dev = y.to(triton_device)
    meta = LoRABatchMeta.build(slots, device=triton_device)
    lora_triton.add_lora(y_dev, x.to(triton_device), _to(weights, triton_device), meta, segments)
    torch.testing.assert_close(y_dev.cpu(), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["decode", "prefill"])
def test_dispatch_runs_triton_on_cuda(layout, lora_batch, lora_weights) -> None:
    weights = lora_weights([[16, 16, 16], [8, 8, 8], [64, 0, 64], [4, 4, 4]], 512, (512, 128, 128),
                           max_rank=64, dtype=torch.bfloat16, seed=15)
    slots = lora_batch("with_base", layout, weights.num_slots, seed=16)
    x = torch.randn(len(slots), 512).bfloat16()
    y = torch.randn(len(slots), 768).bfloat16()
    expected = y.clone()
    add_lora_ref(expected, x, weights, torch.tensor(slots))
    y_dev = y.cuda()
    add_lora(y_dev, x.cuda(), _to(weights, "cuda"), LoRABatchMeta.build(slots, device="cuda"))
    torch.testing.assert_close(y_dev.cpu().float(), expected.float(), atol=0.5, rtol=2e-2)


def _to(weights, device):
    from dataclasses import replace

    return replace(weights, lora_a=weights.lora_a.to(device), lora_b=weights.lora_b.to(device),
                   scaling=weights.scaling.to(device), ranks=weights.ranks.to(device))
