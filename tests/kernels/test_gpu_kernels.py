"""Compiled Triton kernels against the torch reference twins at realistic sizes (needs a CUDA device).

Llama-3-8B-like attention (32 query heads, 8 kv heads, head_dim 128, 16-token blocks, contexts to 4096),
the edges of the exported launch tables (16 query heads per kv head, head_dim 256, fp32 data), and the
LoRA ops at hidden 4096 with ranks 8/16/64 mixed over the adapter popularity mixes. bench/gpu.sh runs
these with the rest of tests/kernels on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from kernels.attention import paged_attention, paged_attention_ref  # noqa: E402
from kernels.lora import add_lora, add_lora_ref, lora_expand, lora_shrink, lora_shrink_ref  # noqa: E402
from kernels.lora_meta import LoRABatchMeta  # noqa: E402

TOLERANCE = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
MIXES = ["distinct", "uniform", "skewed", "identical", "with_base"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 1024])
def test_attention_llama3_8b_shapes(dtype, window, paged_batch) -> None:
    query_lens = [1] * 48 + [512, 37, 2, 1000]  # decode, a prefill chunk, short chunks, a fresh prompt
    seq_lens = [17, 300, 4096, 1024] * 12 + [1536, 3000, 4000, 1000]
    batch = paged_batch(query_lens, seq_lens, block_size=16, num_kv_heads=8, group=4, head_dim=128,
                        dtype=dtype, seed=41)
    out = paged_attention(*batch.args("cuda"), 128**-0.5, window)
    ref = paged_attention_ref(*batch.args("cuda"), 128**-0.5, window)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim", "dtype"), [
    (2, 16, 128, torch.bfloat16),  # tl.dot decode path
    (1, 16, 256, torch.float32),
    (4, 7, 128, torch.bfloat16),  # Qwen2.5-7B: 28 / 4 heads
    (3, 3, 64, torch.float32),  # SmolLM shape, fp32
    (2, 8, 256, torch.float16),
    (2, 2, 16, torch.bfloat16),  # the tiny test models
])
def test_attention_table_edges(num_kv_heads, group, head_dim, dtype, paged_batch) -> None:
    batch = paged_batch([1] * 8 + [200, 9], [700] * 4 + [33] * 4 + [900, 9], block_size=16,
                        num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, dtype=dtype, seed=head_dim + group)
    for window in (None, 100):
        out = paged_attention(*batch.args("cuda"), head_dim**-0.5, window)
        ref = paged_attention_ref(*batch.args("cuda"), head_dim**-0.5, window)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["decode", "prefill"])
@pytest.mark.parametrize("mix", MIXES)
def test_lora_hidden_4096_mixed_ranks(mix, layout, dtype, lora_weights) -> None:
    ranks = [[[8, 16, 64][s % 3]] * 3 for s in range(12)] + [[64, 0, 16]]
    weights = _to(lora_weights(ranks, 4096, (4096, 1024, 1024), max_rank=64, dtype=dtype, seed=42), "cuda")
    gen = torch.Generator().manual_seed(43)
    slots = _slots(mix, layout, weights.num_slots, gen)
    token_slots = torch.tensor(slots, device="cuda")
    x = (torch.randn(len(slots), 4096, generator=gen) * 0.05).to(dtype).cuda()
    y = torch.randn(len(slots), 6144, generator=gen).to(dtype).cuda()
    expected = y.clone()
    add_lora_ref(expected, x, weights, token_slots)  # the twin on the GPU: it gathers (T, 192, 4096) factors
    meta = LoRABatchMeta.build(slots, device="cuda")
    for mode in ("tokens", "segments"):
        buf = lora_shrink(x, weights, meta, mode=mode)
        torch.testing.assert_close(buf, lora_shrink_ref(x, weights, token_slots), atol=0.05, rtol=2e-2)
        y_dev = y.clone()
        lora_expand(y_dev, buf, weights, meta, mode=mode)
        _close(y_dev, expected)
    y_dev = y.clone()
    add_lora(y_dev, x, weights, meta)
    _close(y_dev, expected)


def _close(y_dev: torch.Tensor, expected: torch.Tensor) -> None:
    err = (y_dev.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert err < 2e-2, f"relative error {err:.3g}"


def _slots(mix: str, layout: str, num_slots: int, gen: torch.Generator) -> list[int]:
    """Per-token slots: 64 decode tokens, or 8 prefill chunks of 16..160 tokens, under an adapter mix."""
    n = 64 if layout == "decode" else 8
    if mix == "distinct":
        per_request = [i % num_slots for i in range(n)]
    elif mix == "identical":
        per_request = [num_slots - 1] * n
    elif mix == "uniform":
        per_request = torch.randint(0, num_slots, (n,), generator=gen).tolist()
    elif mix == "skewed":
        tail = torch.randint(1, num_slots, (n,), generator=gen)
        per_request = torch.where(torch.rand(n, generator=gen) < 0.7, 0, tail).tolist()
    else:  # with_base
        per_request = torch.randint(-1, num_slots, (n,), generator=gen).tolist()
    if layout == "decode":
        return per_request
    lengths = torch.randint(16, 161, (n,), generator=gen).tolist()
    return [s for s, length in zip(per_request, lengths, strict=True) for _ in range(length)]


def _to(weights, device):
    from dataclasses import replace

    return replace(weights, lora_a=weights.lora_a.to(device), lora_b=weights.lora_b.to(device),
                   scaling=weights.scaling.to(device), ranks=weights.ranks.to(device))
