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

from kernels.launch_config import DATA_DTYPES, KernelVariant, LaunchConfig, variant

# Scores of keys a query may not see; finite initial running max avoids inf - inf in the rescale.
# NOTE: a tl.constexpr, not a float: compiled kernels may read only constexpr globals (the interpreter
# accepts any global, so only an ahead-of-time compile, tests/kernels/test_triton_compile.py, catches it).
_RUNNING_MAX_INIT = tl.constexpr(-1.0e30)


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
    USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One query token per sequence; one program per (decode sequence, kv head) covers its G query heads.

    Semantics:
        s = decode_seqs[pid0], t = query_start_loc[s], p = seq_lens[s] - 1, kv = pid1
        out[t, kv*G + g] = softmax_j(scale * q[t, kv*G + g] . K_s[j, kv]) @ V_s[j, kv]
        for j in max(0, p - sliding_window + 1) .. p (the window only when USE_WINDOW),
        K_s[j] = k_cache[block_tables[s, j // block_size], j % block_size]; online softmax in fp32.
        USE_DOT (BLOCK_G >= 16: the group's heads fill a tensor-core tile): scores and P @ V by tl.dot in the
        input dtype with fp32 accumulation, P rounded to V's dtype (upcast to fp32 first when DOT_FP32, as in
        the prefill kernel); otherwise fp32 multiply-and-sum, whose (G, N, D) product must fit in registers.
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
    )  # (BLOCK_G, BLOCK_D)
    if DOT_FP32 or not USE_DOT:
        q = q.to(tl.float32)

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
        )  # (BLOCK_N, BLOCK_D)
        v = tl.load(
            v_cache_ptr + block_ids[:, None] * stride_v_block + in_block[:, None] * stride_v_off
            + kv_head * stride_v_head + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )
        if DOT_FP32 or not USE_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if not USE_DOT:
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # (BLOCK_G, BLOCK_N)
        elif DOT_FP32:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if not USE_DOT:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        elif DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
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


# BLOCK_G of decode: query heads per kv head, padded to a power of two. At 16 they fill a tensor-core tile.
GROUP_TILES = (1, 2, 4, 8, 16)
# BLOCK_D: head_dim padded to a power of two, at least 64: no Llama-family checkpoint has a smaller head
# (the tiny test models do, and pay the padding), and every tile here is a set of variants to compile.
HEAD_DIM_TILES = (64, 128, 256)
MAX_GROUP, MAX_HEAD_DIM = GROUP_TILES[-1], HEAD_DIM_TILES[-1]
# Prefill query tiles: "short" when every sequence's query fits in 16 rows, else "long".
QUERY_TILES = ("short", "long")


def _decode_launch(block_g: int, block_d: int) -> LaunchConfig:
    if block_g >= 16:  # tl.dot path: (G, D) x (D, N) and (G, N) x (N, D) tiles
        return LaunchConfig.of(BLOCK_G=block_g, BLOCK_N=16, BLOCK_D=block_d)
    # Multiply-and-sum path: the (G, N, D) fp32 product lives in registers. 8192 elements over 4 warps stay
    # near 150 registers a thread (16384 reach the 255 limit); at D = 256 ptxas spills already at 8192 on
    # sm_80, hence 4096 there.
    budget = 4096 if block_d >= 256 else 8192
    return LaunchConfig.of(BLOCK_G=block_g, BLOCK_N=min(16, budget // (block_g * block_d)), BLOCK_D=block_d)


def _prefill_launch(query_tile: str, block_d: int, fp32: bool) -> LaunchConfig:
    # Chosen so that no variant spills registers on sm_80 or sm_90 (python -m kernels.triton_aot) and few
    # sit at the 255-register ceiling, keeping the original 16- and 64-row query tiles where they fit. fp32 reduces with FMAs (ieee dots), which need
    # narrower tiles than 16-bit tensor-core dots. Speed among spill-free tiles is still to be timed on a GPU.
    if query_tile == "short":  # BLOCK_M = 16
        if fp32:
            return LaunchConfig.of(BLOCK_M=16, BLOCK_N=32 if block_d <= 64 else 16, BLOCK_D=block_d)
        return LaunchConfig.of(num_warps=8 if block_d >= 128 else 4, BLOCK_M=16, BLOCK_N=32, BLOCK_D=block_d)
    if not fp32:
        if block_d <= 64:
            return LaunchConfig.of(BLOCK_M=64, BLOCK_N=32, BLOCK_D=block_d)
        if block_d <= 128:
            return LaunchConfig.of(num_warps=8, BLOCK_M=64, BLOCK_N=32, BLOCK_D=block_d)
        return LaunchConfig.of(num_warps=8, BLOCK_M=32, BLOCK_N=16, BLOCK_D=block_d)
    if block_d <= 128:
        return LaunchConfig.of(num_warps=8, BLOCK_M=64, BLOCK_N=16, BLOCK_D=block_d)
    return LaunchConfig.of(BLOCK_M=16, BLOCK_N=16, BLOCK_D=block_d)


# (BLOCK_G, BLOCK_D) -> decode launch; (query tile, BLOCK_D, fp32 data) -> prefill launch.
DECODE_CONFIGS: dict[tuple[int, int], LaunchConfig] = {
    (g, d): _decode_launch(g, d) for g in GROUP_TILES for d in HEAD_DIM_TILES
}
PREFILL_CONFIGS: dict[tuple[str, int, bool], LaunchConfig] = {
    (m, d, fp32): _prefill_launch(m, d, fp32) for m in QUERY_TILES for d in HEAD_DIM_TILES for fp32 in (False, True)
}


def decode_config(group: int, head_dim: int) -> LaunchConfig:
    """The DECODE_CONFIGS entry for `group` query heads per kv head and `head_dim`."""
    return DECODE_CONFIGS[(triton.next_power_of_2(group), _head_dim_tile(head_dim))]


def prefill_config(max_query_len: int, head_dim: int, dtype: torch.dtype) -> LaunchConfig:
    """The PREFILL_CONFIGS entry for a launch whose longest query has `max_query_len` tokens."""
    tile = "short" if max_query_len <= 16 else "long"
    return PREFILL_CONFIGS[(tile, _head_dim_tile(head_dim), dtype == torch.float32)]


def compile_variants() -> list[KernelVariant]:
    """Every (kernel, launch config, dtype, window or not) the dispatch below can launch, for
    kernels.triton_aot. GROUP and HEAD_DIM are compiled at their tiles' full size (no masked lanes).

    Sliding-window variants repeat each launch config with a few more integer ops; the default suite
    compiles them in bf16 only (the serving dtype; fp16 has needed the same shared memory and registers
    within a dozen of bf16's in every config), the full sweep in every dtype.
    """
    data = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")
    variants = []
    for dtype in DATA_DTYPES:
        dot_fp32 = _dot_fp32(DATA_DTYPES[dtype])
        for window in (False, True):
            tier = "full" if window and dtype != "bf16" else "default"
            for (g, d), config in DECODE_CONFIGS.items():
                flags = {"GROUP": g, "HEAD_DIM": d, "USE_WINDOW": window, "USE_DOT": g >= 16, "DOT_FP32": dot_fp32}
                variants.append(variant(_decode_kernel, dtype, config, flags, data, fp32_scalars=("scale",),
                                        tier=tier))
            for (_, d, fp32), config in PREFILL_CONFIGS.items():
                if fp32 == (dtype == "fp32"):
                    flags = {"GROUP": 4, "HEAD_DIM": d, "USE_WINDOW": window, "DOT_FP32": dot_fp32}
                    variants.append(variant(_prefill_kernel, dtype, config, flags, data, fp32_scalars=("scale",),
                                            tier=tier))
    return variants


def _head_dim_tile(head_dim: int) -> int:
    return max(HEAD_DIM_TILES[0], triton.next_power_of_2(head_dim))


def _dot_fp32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or knobs.runtime.interpret


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    decode_seqs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of `paged_attention_ref`: same arguments, same result (fp32 accumulation).

    Sequences with one query token go to the decode kernel, longer ones to the prefill kernel, in one
    call each; sequences with no query tokens are skipped. Reads the query lengths on the host once,
    unless `decode_seqs` ((S,) int32, every sequence's index) says that all of them decode: then nothing
    is read back, and the call can be captured in a CUDA graph (engine.decode_graph).
    Supports up to MAX_GROUP query heads per kv head and head_dim up to MAX_HEAD_DIM.
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
    if group > MAX_GROUP or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"{group} query heads per kv head and head_dim {head_dim}: the Triton kernels support "
                         f"at most {MAX_GROUP} and {MAX_HEAD_DIM}")
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    query_lens: list[int] = []
    prefill_seqs: list[int] = []
    if decode_seqs is None:
        query_lens = torch.diff(query_start_loc).tolist()
        decode_list = [s for s, n in enumerate(query_lens) if n == 1]
        prefill_seqs = [s for s, n in enumerate(query_lens) if n > 1]
        if decode_list:
            decode_seqs = torch.tensor(decode_list, dtype=torch.int32, device=q.device)
    dot_fp32 = _dot_fp32(q.dtype)
    common = dict(
        scale=scale, sliding_window=sliding_window or 0,
        stride_q_tok=q.stride(0), stride_q_head=q.stride(1),
        stride_k_block=k_cache.stride(0), stride_k_off=k_cache.stride(1), stride_k_head=k_cache.stride(2),
        stride_v_block=v_cache.stride(0), stride_v_off=v_cache.stride(1), stride_v_head=v_cache.stride(2),
        stride_o_tok=out.stride(0), stride_o_head=out.stride(1),
        stride_table_seq=block_tables.stride(0), block_size=block_size,
        GROUP=group, HEAD_DIM=head_dim, USE_WINDOW=sliding_window is not None, DOT_FP32=dot_fp32,
    )
    if decode_seqs is not None and decode_seqs.shape[0]:
        config = decode_config(group, head_dim)
        _decode_kernel[(decode_seqs.shape[0], num_kv_heads)](
            q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, decode_seqs,
            USE_DOT=config["BLOCK_G"] >= 16, **config.launch_kwargs(), **common,
        )
    if prefill_seqs:
        seqs = torch.tensor(prefill_seqs, dtype=torch.int32, device=q.device)
        max_query_len = max(query_lens)
        config = prefill_config(max_query_len, head_dim, q.dtype)
        grid = (len(prefill_seqs), triton.cdiv(max_query_len, config["BLOCK_M"]), num_heads)
        _prefill_kernel[grid](
            q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, seqs,
            **config.launch_kwargs(), **common,
        )
    return out
