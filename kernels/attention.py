"""Attention over paged KV: the torch reference (CPU path) and the dispatch to Triton on CUDA.

Layout shared by every implementation:

    k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim)
    block_tables:     (num_seqs, max_blocks_per_seq) int32, padded with 0 past a sequence's blocks
    query_start_loc:  (num_seqs + 1,) int32, cumulative query lengths; query tokens of sequence s are
                      rows query_start_loc[s] : query_start_loc[s + 1] of q
    seq_lens:         (num_seqs,) int32, tokens in KV for sequence s after this step's writes
                      (cached context + this step's query tokens)

Query token i of sequence s sits at absolute position p = seq_lens[s] - query_len[s] + i and attends
keys at positions max(0, p - sliding_window + 1) .. p (causal; the window only when one is set).

The caches hold the model's dtype, or a finer one (EngineConfig.kv_cache_dtype): bfloat16 under float32
queries, or int8. An int8 cache row is one slot's head, head_dim int8 values then their float32 scale
(KV_INT8_SCALE_BYTES, read as 4 bytes), so its last axis is head_dim + 4: the row means values * scale, with
scale = absmax / 127 of the row it was rounded from (quantize_kv), as llama.cpp's q8_0 keeps its scale beside
its block. Attention over an int8 cache scores with the queries rounded the same way (scoring_query); the
native decode kernel also rounds its probabilities to 16 bits against their largest (1/65534 of it). Over a
bf16 cache the queries are rounded to bf16 (scoring_query), and a decode row's probabilities too, normalized
first, before they weigh the bf16 values (the native kernels take bf16 dot products of two keys at a time);
prefill chunks keep float32 probabilities.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from kernels import native_cpu

KV_INT8_SCALE_BYTES = 4  # an int8 cache row's trailing float32 scale

# The cache dtypes the native ops read and write under each query dtype (the model's compute dtype).
NATIVE_CACHE_DTYPES = {torch.float32: (torch.float32, torch.bfloat16, torch.int8),
                       torch.bfloat16: (torch.bfloat16, torch.int8)}


def cache_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """The last axis of a cache in `dtype` for heads of head_dim."""
    return head_dim + KV_INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """(..., D) keys or values -> (..., D + 4) int8 cache rows: per row, scale = absmax / 127 (float32) and
    q = round-half-even(x / scale) (0 where the row is all zeros), the scale's bytes after q. The native
    rope_store_kv rounds the same way (store_kv_row)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, xf / scale, torch.zeros((), dtype=torch.float32, device=x.device))
    q = q.round_().clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor) -> torch.Tensor:
    """(..., D + 4) int8 cache rows -> (..., D) float32 values * scale."""
    head_dim = rows.shape[-1] - KV_INT8_SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)  # (..., 1)
    return rows[..., :head_dim].float() * scale


def scoring_query(q: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """The queries as attention over a cache in cache_dtype scores them: over int8 caches rounded per head the
    way the keys are (dequantize_kv(quantize_kv(q)), float32; llama.cpp rounds the query to its q8_0 keys'
    type too, and the native kernel then multiplies int8 by int8), over bf16 caches rounded to bf16 (in q's
    dtype: llama.cpp rounds an F32 model's query to its f16 keys' type, and the native kernel takes bf16 dot
    products), otherwise q itself."""
    if cache_dtype == torch.int8:
        return dequantize_kv(quantize_kv(q))
    if cache_dtype == torch.bfloat16 and q.dtype != torch.bfloat16:
        return q.to(torch.bfloat16).to(q.dtype)
    return q


def cache_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values (..., D) as rows of a cache in `dtype`."""
    return quantize_kv(x) if dtype == torch.int8 else x.to(dtype)


def cache_values(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache, (..., width), as (..., D) values in `dtype`."""
    return (dequantize_kv(rows) if rows.dtype == torch.int8 else rows).to(dtype)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's keys and values into their cache slots.

    Semantics:
        k_cache.view(-1, H_kv, W)[slot_mapping[t]] = cache_rows(k[t], k_cache.dtype)   for every token t
        (same for v); k, v: (T, H_kv, D); W = D, or D + 4 for an int8 cache;
        slot_mapping: (T,) int64, slot = block_id * block_size + offset.
    Mutates k_cache and v_cache in place.
    """
    for cache, new in ((k_cache, k), (v_cache, v)):
        flat = cache.flatten(0, 1)  # (num_blocks * block_size, H_kv, W); a view for both storage layouts
        flat.index_copy_(0, slot_mapping, cache_rows(new, cache.dtype))


@dataclass(frozen=True)
class StepAttentionPlan:
    """The host-side part of one step's attention, identical for every layer: built once per step.

    Which sequences decode (one query token) and their row indices and ids; the query and sequence lengths
    of the prefill chunks. The torch path's gathered block ids and key mask are made on first use (the
    native kernels never read them; at batch 1 they were ~0.1 ms of every step). Triton reads the tensors.
    """

    starts: list[int]  # query_start_loc as a list
    seq_lens: list[int]
    decode_seqs: list[int]  # indices of the sequences with exactly one query token
    decode_rows: torch.Tensor | None  # (B,) rows of q for those sequences
    decode_ids: torch.Tensor | None  # (B,) int64 the sequences' indices (the native kernel's seq_ids)
    block_tables: torch.Tensor | None = None  # (S, max_blocks) the step's, for the torch path's gather
    block_size: int = 0
    sliding_window: int | None = None

    @classmethod
    def build(cls, block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
              block_size: int, sliding_window: int | None = None) -> StepAttentionPlan:
        starts, lens = query_start_loc.tolist(), seq_lens.tolist()
        decode = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
        if not decode:
            return cls(starts, lens, decode, None, None)
        device = block_tables.device
        return cls(starts, lens, decode, decode_rows=torch.tensor([starts[i] for i in decode], device=device),
                   decode_ids=torch.tensor(decode, dtype=torch.int64, device=device), block_tables=block_tables,
                   block_size=block_size, sliding_window=sliding_window)

    @functools.cached_property
    def _decode_gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.block_tables is not None and self.decode_seqs
        lens = [self.seq_lens[i] for i in self.decode_seqs]
        n_blocks = (max(lens) + self.block_size - 1) // self.block_size
        device = self.block_tables.device
        pos = torch.arange(n_blocks * self.block_size, device=device)
        lens_t = torch.tensor(lens, device=device)
        masked = pos[None, :] >= lens_t[:, None]  # (B, L)
        if self.sliding_window is not None:
            masked |= pos[None, :] <= (lens_t[:, None] - 1 - self.sliding_window)
        return self.block_tables[self.decode_seqs, :n_blocks].reshape(-1), masked

    @property
    def decode_blocks(self) -> torch.Tensor:
        """(B * nb,) the decode sequences' block ids, flattened, padded to the longest."""
        return self._decode_gather[0]

    @property
    def decode_masked(self) -> torch.Tensor:
        """(B, nb * block_size) True where a key is not visible to the decode row."""
        return self._decode_gather[1]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    plan: StepAttentionPlan | None = None,
) -> torch.Tensor:
    """Varlen causal attention of a mixed prefill/decode batch over paged KV (torch reference).

    Semantics:
        out[t, h] = softmax_j(scale * q[t, h] . K_s[j, h // G]) @ V_s[j, h // G]
        over the keys j allowed for token t (see the module docstring), where K_s / V_s are sequence
        s's keys and values read through its block table and G = H_q / H_kv (grouped-query attention).
        q: (T, H_q, D) -> out: (T, H_q, D), in q's dtype, accumulated in fp32.

    Decode rows (one query token) are computed together: one gather of every decode sequence's keys
    and values, head-major so the batched matmuls read them without another copy. Prefill chunks run
    one sequence at a time through SDPA. Scores and softmax are fp32; the matmuls run in the cache dtype
    with fp32 accumulation (exact for fp32). `plan` (StepAttentionPlan.build of the same metadata) saves
    every layer after the first from recomputing it. This is the CPU path; it does not modify the caches.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if plan is None:
        plan = StepAttentionPlan.build(block_tables, query_start_loc, seq_lens, block_size, sliding_window)
    group = num_heads // num_kv_heads
    only_decode = len(plan.decode_seqs) == len(plan.seq_lens) == num_tokens  # rows 0..B-1 in order
    # (H_kv, num_blocks, block_size, D) views: a gather over blocks then yields head-major tensors
    k_heads, v_heads = k_cache.permute(2, 0, 1, 3), v_cache.permute(2, 0, 1, 3)
    attn = None
    if plan.decode_seqs:
        assert plan.decode_rows is not None
        b, length = plan.decode_masked.shape
        keys = _readable(k_heads.index_select(1, plan.decode_blocks), q.dtype).view(num_kv_heads * b, length, head_dim)
        values = _readable(v_heads.index_select(1, plan.decode_blocks), q.dtype).view(num_kv_heads * b, length,
                                                                                      head_dim)
        qd = scoring_query(q if only_decode else q[plan.decode_rows], k_cache.dtype)
        qd = qd.view(b, num_kv_heads, group, head_dim).transpose(0, 1)
        qd = qd.reshape(num_kv_heads * b, group, head_dim).to(keys.dtype)
        scores = torch.bmm(qd, keys.transpose(1, 2)).float().view(num_kv_heads, b, group, length)
        scores = scores.mul_(scale).masked_fill_(plan.decode_masked[None, :, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(num_kv_heads * b, group, length)  # (H_kv * B, G, L)
        if values.dtype != torch.float32:  # the product in the cache's dtype
            probs = probs.to(values.dtype)
        elif v_cache.dtype == torch.bfloat16:  # float32 q: bf16 values still weigh bf16 probabilities
            probs = probs.to(torch.bfloat16).float()
        attn = torch.bmm(probs, values).view(num_kv_heads, b, group, head_dim)  # (H_kv, B, G, D)
        attn = attn.transpose(0, 1).reshape(b, num_heads, head_dim).to(q.dtype)  # (B, H_q, D)
        if only_decode:
            return attn
    return _with_prefill_rows(q, attn, k_cache, v_cache, block_tables, scale, sliding_window, plan)


def _readable(rows: torch.Tensor, q_dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows as the reference multiplies them: in their dtype when it is q's, else (a finer
    cache) in float32."""
    return rows if rows.dtype == q_dtype else cache_values(rows, torch.float32)


def _with_prefill_rows(q: torch.Tensor, decode_out: torch.Tensor | None, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, block_tables: torch.Tensor, scale: float, sliding_window: int | None,
                       plan: StepAttentionPlan, ops: Any = None) -> torch.Tensor:
    """The step's output: `decode_out` (the decode rows, computed by either path) placed at their rows,
    and every prefill chunk (more than one query token) computed one sequence at a time: by the native
    kernel when `ops` has one for these shapes, else in torch."""
    native = (ops is not None and ops.has_prefill_attention() and q.shape[2] in (64, 128)
              and k_cache.stride() == v_cache.stride())
    out = torch.empty_like(q)
    if decode_out is not None:
        out[plan.decode_rows] = decode_out
    block_size = k_cache.shape[1]
    k_heads, v_heads = k_cache.permute(2, 0, 1, 3), v_cache.permute(2, 0, 1, 3)
    starts, lens = plan.starts, plan.seq_lens
    for i in range(len(lens)):
        n = starts[i + 1] - starts[i]
        if n <= 1:
            continue
        seq_len = lens[i]
        n_blocks = (seq_len + block_size - 1) // block_size
        table = block_tables[i, :n_blocks]
        if native:  # a finer cache: the op widens the sequence's blocks to q's dtype first
            out[starts[i] : starts[i + 1]] = ops.prefill_attention(
                q[starts[i] : starts[i + 1]], k_cache, v_cache, table.to(torch.int32).contiguous(), seq_len, scale,
                sliding_window or 0)
            continue
        chunk = scoring_query(q[starts[i] : starts[i + 1]], k_cache.dtype).float()
        keys = cache_values(k_heads.index_select(1, table), torch.float32).flatten(1, 2)[:, :seq_len]  # (H_kv, S, D)
        values = cache_values(v_heads.index_select(1, table), torch.float32).flatten(1, 2)[:, :seq_len]
        out[starts[i] : starts[i + 1]] = _prefill_chunk(chunk, keys, values, scale, sliding_window).to(q.dtype)
    return out


def paged_attention_native(
    ops: Any, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
    plan: StepAttentionPlan | None = None,
) -> torch.Tensor:
    """The CPU path with the native kernels (kernels/native_cpu.py): decode rows read the paged cache in
    place; prefill chunks run flash-style over it (blocks of 32 queries x 64 keys, 16 at head_dim 128,
    online softmax), both in fp32 throughout. Same semantics as the reference (which rounds bf16 probabilities first)."""
    if plan is None:
        plan = StepAttentionPlan.build(block_tables, query_start_loc, seq_lens, k_cache.shape[1], sliding_window)
    decode_out = None
    if plan.decode_seqs:
        only_decode = len(plan.decode_seqs) == len(plan.seq_lens) == q.shape[0]
        lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
        tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
        decode_out = ops.decode_attention(q if only_decode else q[plan.decode_rows], k_cache, v_cache, tables,
                                          plan.decode_ids, lens.contiguous(), scale, sliding_window or 0)
        if only_decode:
            return decode_out
    return _with_prefill_rows(q, decode_out, k_cache, v_cache, block_tables, scale, sliding_window, plan, ops)


PREFILL_QUERY_BLOCK = 128  # query rows per block of a prefill chunk's attention


def _prefill_chunk(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                   sliding_window: int | None) -> torch.Tensor:
    """One sequence's prefill chunk in fp32: q (n, H_q, D) at the last n of S positions, keys / values
    (H_kv, S, D) -> (n, H_q, D).

    Blocks of PREFILL_QUERY_BLOCK queries each multiply only the keys some query of the block can see
    (causal: up to the block's last position; windowed: from its first query's window start), so a long
    prompt's chunk does about half the work of a full (n, S) product. Every query head of a kv head shares
    one batched matmul. The masked scores are filled in place: no mask tensor beyond the block's.
    (torch's SDPA took ~50% of a 512-token prefill here, on its math path with a boolean mask.)
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads, seq_len = keys.shape[0], keys.shape[1]
    group, start = num_heads // num_kv_heads, seq_len - n
    qh = q.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # (H_kv, G, n, D)
    out = torch.empty(num_kv_heads, group, n, head_dim, dtype=q.dtype, device=q.device)
    for q0 in range(0, n, PREFILL_QUERY_BLOCK):
        q1 = min(n, q0 + PREFILL_QUERY_BLOCK)
        k_hi = start + q1  # keys visible to the block's last query
        k_lo = 0 if sliding_window is None else max(0, start + q0 - sliding_window + 1)
        rows, cols = q1 - q0, k_hi - k_lo
        qb = qh[:, :, q0:q1].reshape(num_kv_heads, group * rows, head_dim)
        scores = torch.bmm(qb, keys[:, k_lo:k_hi].transpose(1, 2)).view(num_kv_heads, group, rows, cols)
        q_pos = torch.arange(start + q0, start + q1, device=q.device)
        k_pos = torch.arange(k_lo, k_hi, device=q.device)
        masked = k_pos[None, :] > q_pos[:, None]  # (rows, cols)
        if sliding_window is not None:
            masked |= k_pos[None, :] <= (q_pos[:, None] - sliding_window)
        scores.mul_(scale).masked_fill_(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * rows, cols)
        out[:, :, q0:q1] = torch.bmm(probs, values[:, k_lo:k_hi]).view(num_kv_heads, group, rows, head_dim)
    return out.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    plan: StepAttentionPlan | None = None,
    decode_seqs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatch: Triton kernels on CUDA; on the CPU the native decode and prefill kernels where they are
    built (kernels/native_cpu.py), the torch reference elsewhere. Same semantics as the reference.

    `plan` is the torch path's per-step precomputation (see StepAttentionPlan); Triton ignores it.
    `decode_seqs`: every sequence's index when all of them have one query token (Triton then reads no
    query length on the host: a CUDA graph can hold the call); the torch path ignores it.
    """
    if q.is_cuda:
        from kernels import attention_triton

        return attention_triton.paged_attention(
            q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window, decode_seqs
        )
    ops = native_cpu.available_for(q)
    if ops is not None and k_cache.dtype in NATIVE_CACHE_DTYPES[q.dtype]:
        return paged_attention_native(ops, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                      sliding_window, plan)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window,
                               plan)
