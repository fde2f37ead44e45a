"""KV caches finer than the compute dtype (EngineConfig.kv_cache_dtype): int8 rows with their scales, and
bf16 caches under float32 queries. The native ops write them exactly as the torch twins do. What attention
computes is the naive float64 reference over the dequantized cache, with the queries rounded like the keys
over an int8 cache and to bf16 over a bf16 one (kernels.attention.scoring_query); a decode row over bf16 values
weighs bf16 probabilities (the reference rounds them the same way), and the native int8 kernel rounds its
probabilities to 16 bits (measured: 5e-5 off the reference in fp32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.attention import (
    KV_INT8_SCALE_BYTES,
    StepAttentionPlan,
    cache_row_width,
    cache_values,
    dequantize_kv,
    paged_attention,
    paged_attention_ref,
    quantize_kv,
    scoring_query,
    write_kv,
)
from kernels.fused import rope_store_kv

CASES = [(torch.float32, torch.int8), (torch.bfloat16, torch.int8), (torch.float32, torch.bfloat16)]  # (q, cache)


def test_int8_rows_round_to_half_a_step_of_their_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-3, 2, 50)[:, None, None]  # rows of every scale
    x[7, 1] = 0.0  # an all-zero row: scale 0, values 0
    rows = quantize_kv(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 64 + KV_INT8_SCALE_BYTES)
    scale = rows[..., 64:].contiguous().view(torch.float32)
    torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True) / 127, rtol=0, atol=0)
    assert rows[..., :64].abs().max() == 127 and rows[..., :64].min() >= -127  # the absmax maps to +-127
    err = (dequantize_kv(rows) - x).abs()
    assert bool((err <= scale * 0.5 * (1 + 1e-5)).all())
    assert torch.equal(dequantize_kv(rows)[7, 1], torch.zeros(64)) and scale[7, 1].item() == 0.0
    bf = x.to(torch.bfloat16)  # bf16 sources are widened exactly first
    assert torch.equal(quantize_kv(bf), quantize_kv(bf.float()))


def _finer(batch, cache_dtype, head_major=False):
    """`batch` with its caches stored in cache_dtype, and the same batch holding what those caches mean."""
    k, v = (quantize_kv(t) if cache_dtype == torch.int8 else t.to(cache_dtype) for t in (batch.k_cache, batch.v_cache))
    if head_major:  # the engine's CPU storage
        k, v = (t.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3) for t in (k, v))
    meant = dataclasses.replace(batch, q=scoring_query(batch.q, cache_dtype),
                                k_cache=cache_values(k, torch.float32), v_cache=cache_values(v, torch.float32))
    return k, v, meant


def _probs(cache_dtype):
    """What a decode row's probabilities are rounded to before they weigh the values (None: kept)."""
    return torch.bfloat16 if cache_dtype == torch.bfloat16 else None


def _tolerance(q_dtype, cache_dtype):
    if q_dtype == torch.bfloat16:
        return 2e-2  # the output's own rounding (and bf16 q rounded again)
    if cache_dtype == torch.bfloat16:
        # probabilities rounded to bf16: one that sits within fp32 noise of a rounding boundary may round the
        # other way than the float64 reference's, moving its row by up to p * 2^-8 * |v|: ~6e-4 for p = 0.05
        # and |v| = 3 in a 100-key row of these randn rows (measured: 4.6e-5 on the portable kernel, 1.4e-4 on
        # the AVX2 one, which sums each score in 8 lanes then a tree)
        return 1e-3
    return 2e-4  # int8: 16-bit probabilities


@pytest.mark.parametrize(("q_dtype", "cache_dtype"), CASES)
@pytest.mark.parametrize(("block_size", "num_kv_heads", "group", "head_dim", "window"),
                         [(16, 3, 3, 64, None), (8, 2, 4, 128, 40), (4, 2, 2, 32, None), (16, 1, 5, 64, 9),
                          (32, 2, 6, 64, None), (16, 1, 3, 128, None)])  # int8, D 64: heads in passes of 4
@pytest.mark.parametrize("head_major", [False, True])
def test_decode_attention_over_a_finer_cache_matches_the_naive_reference(
        ops, paged_batch, dense_attention, q_dtype, cache_dtype, block_size, num_kv_heads, group, head_dim, window,
        head_major):
    """AVX-512 builds run head_dim 64 / 128 on their kernel, 32 on the portable one; AVX2 builds run float32,
    bf16 and int8 rows of any head_dim that is a multiple of 16 on their kernel (int8 rows widened to fp32)."""
    lens = [1, 37, 5, 100, 64, 16, 17, 600]  # 600: the int8 kernel's int32 sums flushed every 256 keys
    batch = paged_batch([1] * len(lens), lens, block_size=block_size, num_kv_heads=num_kv_heads, group=group,
                        head_dim=head_dim, dtype=q_dtype, seed=head_dim + group)
    k, v, meant = _finer(batch, cache_dtype, head_major)
    scale = head_dim**-0.5
    out = ops.decode_attention(batch.q, k, v, batch.block_tables, torch.arange(len(lens)), batch.seq_lens, scale,
                               window or 0)
    assert out.dtype == q_dtype and out.shape == batch.q.shape
    tol = _tolerance(q_dtype, cache_dtype)
    torch.testing.assert_close(out.double(), dense_attention(meant, scale, window, _probs(cache_dtype)), atol=tol,
                               rtol=tol)


@pytest.mark.parametrize(("q_dtype", "cache_dtype"), CASES)
@pytest.mark.parametrize("head_dim", [64, 32])
def test_mixed_batches_over_a_finer_cache_equal_the_reference(ops, paged_batch, dense_attention, q_dtype,
                                                              cache_dtype, head_dim):
    """Prefill chunks and decode rows in one step, through the dispatch (native) and the torch reference."""
    batch = paged_batch([1, 7, 1, 12, 3, 1], [9, 7, 20, 33, 5, 1], block_size=4, num_kv_heads=2, group=2,
                        head_dim=head_dim, dtype=q_dtype, seed=1)
    k, v, meant = _finer(batch, cache_dtype, head_major=True)
    plan = StepAttentionPlan.build(batch.block_tables, batch.query_start_loc, batch.seq_lens, 4, 6)
    rest = (batch.block_tables, batch.query_start_loc, batch.seq_lens, 0.2, 6, plan)
    got, ref = paged_attention(batch.q, k, v, *rest), paged_attention_ref(batch.q, k, v, *rest)
    want = dense_attention(meant, 0.2, 6, _probs(cache_dtype))
    tol = _tolerance(q_dtype, cache_dtype)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(ref.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize(("q_dtype", "cache_dtype"), CASES)
def test_rope_store_kv_writes_a_finer_cache_as_write_kv_does(ops, q_dtype, cache_dtype):
    """Bit for bit: the native store rounds to int8 (or bf16) exactly as quantize_kv (or .to) does."""
    g = torch.Generator().manual_seed(6)
    n_tok, hq, hkv, d, block_size, blocks = 5, 6, 2, 64, 4, 8
    qkv = (torch.randn(n_tok, (hq + 2 * hkv) * d, generator=g) * 3).to(q_dtype)
    qkv[2, (hq + hkv) * d : (hq + hkv + 1) * d] = 0  # one all-zero value row
    pos = torch.tensor([0, 3, 17, 100, 2047])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([torch.outer(pos.float(), inv)] * 2, dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    slots = torch.tensor([3, 0, 17, 30, 9])
    width = cache_row_width(d, cache_dtype)
    storage = torch.zeros(2, hkv, blocks, block_size, width, dtype=cache_dtype)  # head-major k and v caches
    k_cache, v_cache = storage[0].permute(1, 2, 0, 3), storage[1].permute(1, 2, 0, 3)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    mine = qkv.clone()
    qk = mine[:, : (hq + hkv) * d].view(n_tok, hq + hkv, d)
    v = mine[:, (hq + hkv) * d :].view(n_tok, hkv, d)
    rope_store_kv(qk, v, cos, sin, hq, k_cache, v_cache, slots)
    write_kv(qk[:, hq:], v, ref_k, ref_v, slots)  # the keys as the native op rotated them
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert k_cache.flatten(0, 1)[slots].abs().sum() > 0


def test_caches_coarser_than_q_are_refused(ops, paged_batch):
    batch = paged_batch([1], [5], block_size=4, num_kv_heads=1, group=2, head_dim=64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="not finer than q"):
        ops.decode_attention(batch.q, batch.k_cache.float(), batch.v_cache.float(), batch.block_tables,
                             torch.arange(1), batch.seq_lens, 0.125, 0)
    with pytest.raises(RuntimeError, match="head_dim"):  # an int8 cache read as if its rows had no scale
        ops.decode_attention(batch.q, batch.k_cache.to(torch.int8), batch.v_cache.to(torch.int8), batch.block_tables,
                             torch.arange(1), batch.seq_lens, 0.125, 0)
