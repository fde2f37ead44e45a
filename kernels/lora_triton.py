"""Triton kernels behind `kernels.lora`: shrink and expand, per token (BGMV-like) or per segment (SGMV-like).

Mixed ranks share one launch: buffers are padded to the max rank and each program reads its slot's rank,
so the reduction loop of expand and the A rows of shrink stop at the real rank (padded work is masked or
skipped, never computed into the result). Whether rank groups (one launch per rank) beat this must be
measured on a GPU; under the interpreter timings mean nothing.

Launch configurations come from SHRINK_CONFIGS and EXPAND_CONFIGS only; `compile_variants()` lists each in
each dtype for the ahead-of-time compile check (kernels.triton_aot). Shrink tiles the rank axis (at most
MAX_RANK_TILE columns per program), so any max rank uses one of a few compiled variants.

NOTE: `@triton.jit` decides interpreted vs compiled at import (TRITON_INTERPRET); `kernels.lora` imports
this module lazily, on CUDA tensors only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

from kernels.launch_config import DATA_DTYPES, KernelVariant, LaunchConfig, variant
from kernels.lora_meta import LoRABatchMeta
from kernels.lora_weights import LoRAStackedWeights


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, buf_ptr, ranks_ptr, row_starts_ptr, row_slots_ptr,
    in_features, max_rank, num_r_tiles,
    stride_x, stride_a_slot, stride_a_rank, stride_buf, stride_ranks_slot,
    DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Rows row_starts[g] : row_starts[g+1] all use slot row_slots[g]; one program per (group g, slice i x
    rank tile, row tile), a rank tile being BLOCK_R of the R = max_rank columns of slice i.

    Semantics:
        buf[t, i*R + j] = sum_k x[t, k] * A[s, i*R + j, k]   for j < ranks[s, i], s = row_slots[g] >= 0
        buf[t, i*R + j] = 0                                   otherwise (slot -1, padded rank)
    Per-token mode passes one group per token (row_starts = arange(T + 1)); segment mode the segments.
    DOT_FP32 upcasts x and A before tl.dot (fp32 inputs; the interpreter's low-precision dots are wrong).
    """
    group = tl.program_id(0)
    slice_idx = tl.program_id(1) // num_r_tiles
    r_start = (tl.program_id(1) % num_r_tiles) * BLOCK_R
    row_start = tl.load(row_starts_ptr + group)
    row_end = tl.load(row_starts_ptr + group + 1)
    rows = row_start + tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    if row_start + tl.program_id(2) * BLOCK_M >= row_end:
        return
    slot = tl.load(row_slots_ptr + group)
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0) * stride_ranks_slot + slice_idx)
    rank = tl.where(slot >= 0, rank, 0)
    offs_r = r_start + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = rows < row_end
    mask_r = offs_r < rank
    a_base = a_ptr + tl.maximum(slot, 0) * stride_a_slot + (slice_idx * max_rank + offs_r) * stride_a_rank

    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    k_end = tl.where(r_start < rank, in_features, 0)  # no adapter, or the rank ends before this tile: zeros
    for k in range(0, k_end, BLOCK_K):
        mask_k = k + offs_k < in_features
        x = tl.load(x_ptr + rows[:, None] * stride_x + (k + offs_k)[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        a = tl.load(a_base[:, None] + (k + offs_k)[None, :],
                    mask=mask_r[:, None] & mask_k[None, :], other=0.0)  # (BLOCK_R, BLOCK_K)
        if BLOCK_M == 1:  # per-token launch: a matrix-vector product, no tensor-core tile to fill
            acc += tl.sum(x.to(tl.float32)[:, None, :] * a.to(tl.float32)[None, :, :], axis=2)
        elif DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(a))
    tl.store(buf_ptr + rows[:, None] * stride_buf + (slice_idx * max_rank + offs_r)[None, :], acc,
             mask=mask_m[:, None] & (offs_r < max_rank)[None, :])


@triton.jit
def _expand_kernel(
    buf_ptr, b_ptr, y_ptr, ranks_ptr, scaling_ptr, slice_offsets_ptr, slice_sizes_ptr,
    row_starts_ptr, row_slots_ptr,
    max_rank, num_n_tiles,
    stride_buf, stride_b_slot, stride_b_out, stride_y, stride_ranks_slot, stride_scaling_slot,
    DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Rows of group g (slot row_slots[g]); one program per (group, slice x output tile, row tile).

    Semantics:
        y[t, off_i + n] += scaling[s, i] * sum_{j < ranks[s, i]} buf[t, i*R + j] * B[s, off_i + n, j]
        for rows t of the group, n < slice_sizes[i], s = row_slots[g] >= 0; rows with s = -1 untouched.
    The reduction loop runs to the slot's rank, so padded rank columns cost nothing.
    """
    group = tl.program_id(0)
    slice_idx = tl.program_id(1) // num_n_tiles
    n_tile = tl.program_id(1) % num_n_tiles
    row_start = tl.load(row_starts_ptr + group)
    row_end = tl.load(row_starts_ptr + group + 1)
    slot = tl.load(row_slots_ptr + group)
    size = tl.load(slice_sizes_ptr + slice_idx)
    if (slot < 0) | (row_start + tl.program_id(2) * BLOCK_M >= row_end) | (n_tile * BLOCK_N >= size):
        return
    rank = tl.load(ranks_ptr + slot * stride_ranks_slot + slice_idx)
    if rank == 0:
        return
    scale = tl.load(scaling_ptr + slot * stride_scaling_slot + slice_idx)
    offset = tl.load(slice_offsets_ptr + slice_idx)
    rows = row_start + tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    mask_m = rows < row_end
    mask_n = offs_n < size

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r in range(0, rank, BLOCK_R):
        mask_r = r + offs_r < rank
        h = tl.load(buf_ptr + rows[:, None] * stride_buf + (slice_idx * max_rank + r + offs_r)[None, :],
                    mask=mask_m[:, None] & mask_r[None, :], other=0.0)  # (BLOCK_M, BLOCK_R) fp32
        b = tl.load(b_ptr + slot * stride_b_slot + (offset + offs_n)[:, None] * stride_b_out + (r + offs_r)[None, :],
                    mask=mask_n[:, None] & mask_r[None, :], other=0.0)  # (BLOCK_N, BLOCK_R)
        if BLOCK_M == 1:
            acc += tl.sum(h[:, None, :] * b.to(tl.float32)[None, :, :], axis=2)
        elif DOT_FP32:
            acc += tl.dot(h, tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(h.to(b.dtype), tl.trans(b))
    y_ptrs = y_ptr + rows[:, None] * stride_y + (offset + offs_n)[None, :]
    y_mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + scale * acc).to(y_ptr.dtype.element_ty), mask=y_mask)


# BLOCK_M: 1 = one token per program (a matrix-vector product, no tl.dot), else rows of a segment.
ROW_TILES = (1, 16, 32)
# BLOCK_R of shrink: the smallest tile holding max_rank, at most MAX_RANK_TILE (larger ranks take several).
RANK_TILES = (16, 32, 64)
MAX_RANK_TILE = RANK_TILES[-1]



def _shrink_launch(block_m: int, block_r: int, fp32: bool) -> LaunchConfig:
    # A narrower K tile where the x and A tiles would otherwise spill registers, or sit at the 255 ceiling
    # (python -m kernels.triton_aot): fp32 reduces by FMAs (ieee dots), which hold more in registers.
    narrow = block_m > 1 and block_r > 32 and (fp32 or block_m * block_r >= 2048)
    return LaunchConfig.of(BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=32 if narrow else 64)


# (BLOCK_M, BLOCK_R, fp32 data) -> launch
SHRINK_CONFIGS: dict[tuple[int, int, bool], LaunchConfig] = {
    (block_m, block_r, fp32): _shrink_launch(block_m, block_r, fp32)
    for block_m in ROW_TILES for block_r in RANK_TILES for fp32 in (False, True)
}
# (BLOCK_M, fp32 data) -> launch
EXPAND_CONFIGS: dict[tuple[int, bool], LaunchConfig] = {
    (block_m, fp32): LaunchConfig.of(BLOCK_M=block_m, BLOCK_N=64, BLOCK_R=16)
    for block_m in ROW_TILES for fp32 in (False, True)
}


def shrink_config(rows_per_group: int, max_rank: int, dtype: torch.dtype) -> LaunchConfig:
    """The SHRINK_CONFIGS entry for groups of up to `rows_per_group` rows and slots padded to `max_rank`."""
    block_r = min(MAX_RANK_TILE, max(RANK_TILES[0], triton.next_power_of_2(max_rank)))
    return SHRINK_CONFIGS[(_block_m(rows_per_group), block_r, dtype == torch.float32)]


def expand_config(rows_per_group: int, dtype: torch.dtype) -> LaunchConfig:
    """The EXPAND_CONFIGS entry for groups of up to `rows_per_group` rows."""
    return EXPAND_CONFIGS[(_block_m(rows_per_group), dtype == torch.float32)]


def compile_variants() -> list[KernelVariant]:
    """Every (kernel, launch config, dtype) the dispatch below can launch, for kernels.triton_aot."""
    variants = []
    for dtype in DATA_DTYPES:
        fp32 = dtype == "fp32"
        flags = {"DOT_FP32": _dot_fp32(DATA_DTYPES[dtype])}
        variants += [variant(_shrink_kernel, dtype, config, flags, ("x_ptr", "a_ptr"), ("buf_ptr",))
                     for (_, _, is_fp32), config in SHRINK_CONFIGS.items() if is_fp32 == fp32]
        variants += [variant(_expand_kernel, dtype, config, flags, ("b_ptr", "y_ptr"), ("buf_ptr", "scaling_ptr"))
                     for (_, is_fp32), config in EXPAND_CONFIGS.items() if is_fp32 == fp32]
    return variants


def _row_groups(meta: LoRABatchMeta, use_segments: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(row_starts, row_slots, rows per group at most) for segment or per-token launches."""
    if use_segments:
        return meta.seg_starts, meta.seg_slots, meta.max_segment_len
    starts = torch.arange(meta.num_tokens + 1, dtype=torch.int32, device=meta.device)
    return starts, meta.token_slots, 1


def _block_m(rows_per_group: int) -> int:
    # NOTE: tl.dot on GPUs needs every dimension >= 16; one-row tiles take the dot-free branch instead.
    if rows_per_group == 1:
        return 1
    return 16 if rows_per_group <= 16 else 32


def _dot_fp32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or knobs.runtime.interpret


def shrink(x: torch.Tensor, weights: LoRAStackedWeights, meta: LoRABatchMeta, use_segments: bool) -> torch.Tensor:
    """Launch `_shrink_kernel`; returns buf (T, num_slices * max_rank) float32. See `kernels.lora.lora_shrink`."""
    if x.stride(1) != 1 or weights.lora_a.stride(2) != 1:
        raise ValueError("x and lora_a need a contiguous last axis")
    buf = torch.empty(meta.num_tokens, weights.lora_a.shape[1], dtype=torch.float32, device=x.device)
    row_starts, row_slots, rows_per_group = _row_groups(meta, use_segments)
    if meta.num_tokens == 0:
        return buf
    config = shrink_config(rows_per_group, weights.max_rank, x.dtype)
    num_r_tiles = triton.cdiv(weights.max_rank, config["BLOCK_R"])
    grid = (row_slots.shape[0], weights.num_slices * num_r_tiles, triton.cdiv(rows_per_group, config["BLOCK_M"]))
    _shrink_kernel[grid](
        x, weights.lora_a, buf, weights.ranks, row_starts, row_slots,
        weights.in_features, weights.max_rank, num_r_tiles,
        x.stride(0), weights.lora_a.stride(0), weights.lora_a.stride(1), buf.stride(0), weights.ranks.stride(0),
        DOT_FP32=_dot_fp32(x.dtype), **config.launch_kwargs(),
    )
    return buf


def expand(
    y: torch.Tensor, buf: torch.Tensor, weights: LoRAStackedWeights, meta: LoRABatchMeta, use_segments: bool
) -> None:
    """Launch `_expand_kernel`, adding into y in place. See `kernels.lora.lora_expand`."""
    if y.stride(1) != 1 or buf.stride(1) != 1 or weights.lora_b.stride(2) != 1:
        raise ValueError("y, buf and lora_b need a contiguous last axis")
    if buf.dtype != torch.float32:
        raise ValueError(f"buf must be float32, got {buf.dtype}")
    if meta.num_tokens == 0:
        return
    row_starts, row_slots, rows_per_group = _row_groups(meta, use_segments)
    config = expand_config(rows_per_group, weights.lora_b.dtype)
    num_n_tiles = triton.cdiv(max(weights.slice_sizes), config["BLOCK_N"])
    slice_offsets = torch.tensor(weights.slice_offsets, dtype=torch.int32, device=y.device)
    slice_sizes = torch.tensor(weights.slice_sizes, dtype=torch.int32, device=y.device)
    grid = (row_slots.shape[0], weights.num_slices * num_n_tiles, triton.cdiv(rows_per_group, config["BLOCK_M"]))
    _expand_kernel[grid](
        buf, weights.lora_b, y, weights.ranks, weights.scaling, slice_offsets, slice_sizes,
        row_starts, row_slots,
        weights.max_rank, num_n_tiles,
        buf.stride(0), weights.lora_b.stride(0), weights.lora_b.stride(1), y.stride(0),
        weights.ranks.stride(0), weights.scaling.stride(0),
        DOT_FP32=_dot_fp32(weights.lora_b.dtype), **config.launch_kwargs(),
    )


def add_lora(
    y: torch.Tensor, x: torch.Tensor, weights: LoRAStackedWeights, meta: LoRABatchMeta, use_segments: bool
) -> None:
    """Shrink then expand: the Triton twin of `kernels.lora.add_lora` (same Semantics)."""
    expand(y, shrink(x, weights, meta, use_segments), weights, meta, use_segments)
