"""Paged attention in Triton: a decode kernel and a prefill kernel over new tokens plus cached context.

Same layout and semantics as `kernels.attention.paged_attention_ref` (see that module's docstring). Keys
are read position by position through the block table (block id = table[pos // block_size]), so a key
tile may span several cache blocks and the cache block size needs no relation to the tile size.

NOTE: whether `@triton.jit` builds interpreted or compiled kernels is decided when this module is imported
(triton reads TRITON_INTERPRET then). Tests set it before importing; production imports this lazily on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

# Scores of keys a query may not see; finite initial running max avoids inf - inf in the rescale.
_RUNNING_MAX_INIT = -1.0e30


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, decode_seqs_ptr,
    scale, sliding_window,
    stride_q_tok, stride_q_head,
    stride_k_block, stride_k_off, stride_k_head,
    stride_v_block, stride_v_off, stride_v_head,
    stride_o_tok, stride_o_head,
    stride_table_seq,
    block_size,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, USE_WINDOW: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One query token per sequence; one program per (decode sequence, kv head) covers its G query heads.

    Semantics:
        s = decode_seqs[pid0], t = query_start_loc[s], p = seq_lens[s] - 1, kv = pid1
        out[t, kv*G + g] = softmax_j(scale * q[t, kv*G + g] . K_s[j, kv]) @ V_s[j, kv]
        for j in max(0, p - sliding_window + 1) .. p (the window only when USE_WINDOW),
        K_s[j] = k_cache[block_tables[s, j // block_size], j % block_size]; online softmax in fp32.
    """
    seq = tl.load(decode_seqs_ptr + tl.program_id(0))
    kv_head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    pos_q = seq_len - 1

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        q_ptr + token * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :], other=0.0,
    ).to(tl.float32)  # (BLOCK_G, BLOCK_D)

    first = 0
    if USE_WINDOW:
        first = tl.maximum(pos_q - sliding_window + 1, 0)
    first = (first // BLOCK_N) * BLOCK_N
    m_i = tl.full([BLOCK_G], _RUNNING_MAX_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_table_seq
    for start in range(first, seq_len, BLOCK_N):
        pos_k = start + offs_n
        valid = pos_k < seq_len
        if USE_WINDOW:
            valid = valid & (pos_k > pos_q - sliding_window)
        block_ids = tl.load(table + pos_k // block_size, mask=valid, other=0)
        in_block = pos_k % block_size
        kv_mask = valid[:, None] & mask_d[None, :]
        k = tl.load(
            k_cache_ptr + block_ids[:, None] * stride_k_block + in_block[:, None] * stride_k_off
            + kv_head * stride_k_head + offs_d[None, :],
            mask=kv_mask, other=0.0,
        ).to(tl.float32)  # (BLOCK_N, BLOCK_D)
        v = tl.load(
            v_cache_ptr + block_ids[:, None] * stride_v_block + in_block[:, None] * stride_v_off
            + kv_head * stride_v_head + offs_d[None, :],
            mask=kv_mask, other=0.0,
        ).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # (BLOCK_G, BLOCK_N)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + token * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :],
    )


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, prefill_seqs_ptr,
    scale, sliding_window,
    stride_q_tok, stride_q_head,
    stride_k_block, stride_k_off, stride_k_head,
    stride_v_block, stride_v_off, stride_v_head,
    stride_o_tok, stride_o_head,
    stride_table_seq,
    block_size,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """A tile of one sequence's new query tokens for one query head, over cached context and itself.

    Semantics:
        s = prefill_seqs[pid0], n = query_len[s], L = seq_lens[s], rows i in pid1*BLOCK_M + [0, BLOCK_M)
        p_i = L - n + i, h = pid2, kv = h // GROUP
        out[query_start_loc[s] + i, h] = softmax_j(scale * q[., h] . K_s[j, kv]) @ V_s[j, kv]
        for j in max(0, p_i - sliding_window + 1) .. p_i (causal; window only when USE_WINDOW).
        DOT_FP32: upcast q, k, v and probabilities to fp32 before tl.dot (fp32 inputs, and the
        interpreter, whose low-precision dots are wrong); otherwise dots in the input dtype, fp32 accum.
    """
    seq = tl.load(prefill_seqs_ptr + tl.program_id(0))
    tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    first_token = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - first_token
    if tile * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < query_len
    mask_d = offs_d < HEAD_DIM
    pos_q = context_len + offs_m  # (BLOCK_M,)
    q = tl.load(
        q_ptr + (first_token + offs_m[:, None]) * stride_q_tok + head * stride_q_head + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :], other=0.0,
    )  # (BLOCK_M, BLOCK_D)
    if DOT_FP32:
        q = q.to(tl.float32)

    last_pos = context_len + tl.minimum((tile + 1) * BLOCK_M, query_len) - 1
    first = 0
    if USE_WINDOW:
        first = tl.maximum(context_len + tile * BLOCK_M - sliding_window + 1, 0)
    first = (first // BLOCK_N) * BLOCK_N
    m_i = tl.full([BLOCK_M], _RUNNING_MAX_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_table_seq
    for start in range(first, last_pos + 1, BLOCK_N):
        pos_k = start + offs_n
        in_seq = pos_k < seq_len
        block_ids = tl.load(table + pos_k // block_size, mask=in_seq, other=0)
        in_block = pos_k % block_size
        kv_mask = in_seq[:, None] & mask_d[None, :]
        k = tl.load(
            k_cache_ptr + block_ids[:, None] * stride_k_block + in_block[:, None] * stride_k_off
            + kv_head * stride_k_head + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )  # (BLOCK_N, BLOCK_D)
        v = tl.load(
            v_cache_ptr + block_ids[:, None] * stride_v_block + in_block[:, None] * stride_v_off
            + kv_head * stride_v_head + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (BLOCK_M, BLOCK_N)
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        allowed = (pos_k[None, :] <= pos_q[:, None]) & in_seq[None, :]
        if USE_WINDOW:
            allowed = allowed & (pos_k[None, :] > pos_q[:, None] - sliding_window)
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (first_token + offs_m[:, None]) * stride_o_tok + head * stride_o_head + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :],
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Triton twin of `paged_attention_ref`: same arguments, same result (fp32 accumulation).

    Sequences with one query token go to the decode kernel, longer ones to the prefill kernel, in one
    call each; sequences with no query tokens are skipped. Reads the query lengths on the host once.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} do not match "
                         f"head_dim {head_dim}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous head_dim axis")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    group = num_heads // num_kv_heads
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    query_lens = torch.diff(query_start_loc).tolist()
    decode_seqs = [s for s, n in enumerate(query_lens) if n == 1]
    prefill_seqs = [s for s, n in enumerate(query_lens) if n > 1]
    common = dict(
        scale=scale, sliding_window=sliding_window or 0,
        stride_q_tok=q.stride(0), stride_q_head=q.stride(1),
        stride_k_block=k_cache.stride(0), stride_k_off=k_cache.stride(1), stride_k_head=k_cache.stride(2),
        stride_v_block=v_cache.stride(0), stride_v_off=v_cache.stride(1), stride_v_head=v_cache.stride(2),
        stride_o_tok=out.stride(0), stride_o_head=out.stride(1),
        stride_table_seq=block_tables.stride(0), block_size=block_size,
        GROUP=group, HEAD_DIM=head_dim, USE_WINDOW=sliding_window is not None,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    if decode_seqs:
        seqs = torch.tensor(decode_seqs, dtype=torch.int32, device=q.device)
        _decode_kernel[(len(decode_seqs), num_kv_heads)](
            q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, seqs,
            BLOCK_G=triton.next_power_of_2(group), BLOCK_N=16, **common,
        )
    if prefill_seqs:
        seqs = torch.tensor(prefill_seqs, dtype=torch.int32, device=q.device)
        block_m = 16 if max(query_lens) <= 16 else 64
        dot_fp32 = q.dtype == torch.float32 or knobs.runtime.interpret
        grid = (len(prefill_seqs), triton.cdiv(max(query_lens), block_m), num_heads)
        _prefill_kernel[grid](
            q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, seqs,
            DOT_FP32=dot_fp32, BLOCK_M=block_m, BLOCK_N=32, **common,
        )
    return out
