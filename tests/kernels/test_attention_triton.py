"""Triton paged attention against the torch reference (interpreted on CPU here, compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from triton import knobs  # noqa: E402

from kernels import attention_triton  # noqa: E402
from kernels.attention import paged_attention, paged_attention_ref  # noqa: E402

MIXED = ([1, 7, 1, 21, 3, 0, 1], [9, 7, 20, 40, 5, 2, 1])  # decode, prefill, chunk over cache, idle seq

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def test_kernels_are_interpreted_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the kernels are compiled")
    from triton.runtime.interpreter import InterpretedFunction

    assert knobs.runtime.interpret
    assert isinstance(attention_triton._decode_kernel, InterpretedFunction)
    assert isinstance(attention_triton._prefill_kernel, InterpretedFunction)


@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "group", "head_dim", "window", "dtype"),
    [
        (4, 2, 1, 32, None, torch.float32),
        (8, 2, 4, 64, None, torch.float16),
        (16, 1, 2, 128, None, torch.bfloat16),
        (4, 2, 2, 32, 6, torch.float32),
        (8, 1, 8, 64, 3, torch.bfloat16),
        (4, 3, 2, 48, 9, torch.float32),  # head_dim not a power of two: padded and masked
    ],
)
def test_triton_matches_reference(
    block_size, num_kv_heads, group, head_dim, window, dtype, paged_batch, triton_device
) -> None:
    batch = paged_batch(*MIXED, block_size=block_size, num_kv_heads=num_kv_heads, group=group,
                        head_dim=head_dim, dtype=dtype, seed=head_dim + group)
    args = batch.args(triton_device)
    scale = head_dim**-0.5
    out = attention_triton.paged_attention(*args, scale, window)
    assert out.dtype == dtype and out.device.type == triton_device.type
    ref = paged_attention_ref(*batch.args(), scale, window)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=tol, rtol=tol)


def test_triton_matches_naive_with_window_wider_than_context(paged_batch, dense_attention, triton_device) -> None:
    batch = paged_batch([1, 5], [3, 18], block_size=4, num_kv_heads=1, group=2, head_dim=32, seed=3)
    out = attention_triton.paged_attention(*batch.args(triton_device), 0.25, 64)
    torch.testing.assert_close(out.cpu().double(), dense_attention(batch, 0.25, 64), atol=1e-5, rtol=1e-5)


def test_triton_rejects_bad_shapes(paged_batch, triton_device) -> None:
    batch = paged_batch([2], [2], block_size=4, num_kv_heads=2, group=1, head_dim=32)
    q, k_cache, v_cache, tables, starts, lens = batch.args(triton_device)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attention_triton.paged_attention(q[:, :1].repeat(1, 3, 1), k_cache, v_cache, tables, starts, lens, 1.0)
    with pytest.raises(ValueError, match="sliding_window must be positive"):
        attention_triton.paged_attention(q, k_cache, v_cache, tables, starts, lens, 1.0, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dispatch_runs_triton_on_cuda(dtype, paged_batch) -> None:
    batch = paged_batch([1] * 8 + [100, 37], [300] * 4 + [17] * 4 + [100, 500], block_size=16,
                        num_kv_heads=4, group=4, head_dim=128, dtype=dtype, seed=7)
    out = paged_attention(*batch.args("cuda"), 128**-0.5, None)
    ref = paged_attention_ref(*batch.args(), 128**-0.5, None)
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
