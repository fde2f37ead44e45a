"""Triton kernel behind `kernels.quant.linear` on CUDA: a dequantizing GEMM for int8 and int4 weights.

Each program loads a (BLOCK_N, BLOCK_K) tile of int8 values, or of int4 values from the nibbles layout,
dequantizes it in fp32 (int4: the tile's one group scale and zero per column; int8: the row scale is applied
to the fp32 sum at the end) and multiplies it with the activations in their own dtype (ieee fp32 dots for
fp32), accumulating in fp32. BLOCK_K = 32, the smallest int4 group size, so a K tile never spans groups.

Past CUDA_KERNEL_MAX_TOKENS tokens the weight is dequantized to the activation dtype and cuBLAS runs the
GEMM instead. NOTE: that threshold and the tiles below are a first guess: they must be timed on a GPU
(under the interpreter timings mean nothing). Launch configurations come from MATMUL_CONFIGS only;
`compile_variants()` lists each in each dtype and bit width for kernels.triton_aot.

NOTE: `@triton.jit` decides interpreted vs compiled at import (TRITON_INTERPRET); `kernels.quant` imports
this module lazily, on CUDA tensors only.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton import knobs

from kernels.launch_config import DATA_DTYPES, KernelVariant, LaunchConfig, variant
from kernels.quant_weights import Int4Weight, Int8Weight, QuantizedWeight, dequantize_int4, nibble_values


@triton.jit
def _quant_matmul_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    num_tokens, out_features, in_features, group_size,
    stride_x, stride_w, stride_s, stride_y,
    BITS: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program per (BLOCK_M tokens, BLOCK_N output columns).

    Semantics:
        BITS = 8: W[n, k] = w[n, k] * s[n]                              w (N, K) int8, s (N,)
        BITS = 4: W[n, k] = (q[n, k] - 8) * s[g, n, 0] + s[g, n, 1]     g = k // group_size,
                  q[n, k] = (w[n, k // 2] >> 4 * (k % 2)) & 15          w (N, K / 2) uint8, s (K / gs, N, 2)
        y[t, n] = sum_k x[t, k] * W[n, k]                               x (T, K), y (T, N), fp32 sums
    stride_s is s's stride over groups (int4) and unused for int8. group_size is a multiple of BLOCK_K.
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = rows < num_tokens
    mask_n = cols < out_features

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, in_features, BLOCK_K):
        kk = k + offs_k
        mask_k = kk < in_features
        mask_w = mask_n[:, None] & mask_k[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        if BITS == 8:
            w = tl.load(w_ptr + cols[:, None] * stride_w + kk[None, :], mask=mask_w, other=0).to(tl.float32)
        else:
            byte = tl.load(w_ptr + cols[:, None] * stride_w + (kk // 2)[None, :], mask=mask_w, other=0)
            q = (byte.to(tl.int32) >> ((kk % 2) * 4)[None, :]) & 15  # (BLOCK_N, BLOCK_K)
            s_base = s_ptr + (k // group_size) * stride_s + cols * 2
            scale = tl.load(s_base, mask=mask_n, other=0.0).to(tl.float32)
            zero = tl.load(s_base + 1, mask=mask_n, other=0.0).to(tl.float32)
            w = (q.to(tl.float32) - 8.0) * scale[:, None] + zero[:, None]  # (BLOCK_N, BLOCK_K) fp32
        if BLOCK_M == 1:  # one token: a matrix-vector product, no tensor-core tile to fill
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
        elif DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if BITS == 8:
        acc = acc * tl.load(s_ptr + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


# BLOCK_M: 1 = one token (decode at batch 1), 16 = small batches, 64 = larger ones.
ROW_TILES = (1, 16, 64)
BLOCK_K = 32
CUDA_KERNEL_MAX_TOKENS = 256  # above: dequantize to the activation dtype and let cuBLAS run the GEMM


def _launch(block_m: int, fp32: bool) -> LaunchConfig:
    if block_m == 1:
        return LaunchConfig.of(BLOCK_M=1, BLOCK_N=128, BLOCK_K=BLOCK_K, num_warps=4, num_stages=2)
    if fp32:  # ieee fp32 dots: 64-row tiles spill registers on sm_80 and sm_90 (ptxas), 16 x 64 on 8 warps do not
        return LaunchConfig.of(BLOCK_M=16, BLOCK_N=64, BLOCK_K=BLOCK_K, num_warps=8, num_stages=3)
    return LaunchConfig.of(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=BLOCK_K, num_warps=4, num_stages=3)


# (row tile, fp32 data) -> launch
MATMUL_CONFIGS: dict[tuple[int, bool], LaunchConfig] = {
    (block_m, fp32): _launch(block_m, fp32) for block_m in ROW_TILES for fp32 in (False, True)
}
# Triton's pointer type of each bit width's packed weight.
_WEIGHT_TYPES = {8: "*i8", 4: "*u8"}


def matmul_config(num_tokens: int, dtype: torch.dtype) -> LaunchConfig:
    block_m = 1 if num_tokens == 1 else (16 if num_tokens <= 16 else 64)
    return MATMUL_CONFIGS[(block_m, dtype == torch.float32)]


def compile_variants() -> list[KernelVariant]:
    """Every (launch config, dtype, bit width) the dispatch below can launch, for kernels.triton_aot."""
    variants = []
    for dtype in DATA_DTYPES:
        fp32 = dtype == "fp32"
        for bits, weight_type in _WEIGHT_TYPES.items():
            flags = {"BITS": bits, "DOT_FP32": _dot_fp32(DATA_DTYPES[dtype])}
            for (_, is_fp32), config in MATMUL_CONFIGS.items():
                if is_fp32 != fp32:
                    continue
                v = variant(_quant_matmul_kernel, dtype, config, flags, ("x_ptr", "s_ptr", "y_ptr"))
                signature = tuple((n, weight_type if n == "w_ptr" else t) for n, t in v.signature)
                variants.append(dataclasses.replace(v, signature=signature))
    return variants


def _dot_fp32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or knobs.runtime.interpret


def matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """Launch `_quant_matmul_kernel`: x @ W.T (T, N) in x's dtype, no bias."""
    if x.stride(1) != 1:
        raise ValueError("x needs a contiguous last axis")
    n, k = w.shape
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return y
    if isinstance(w, Int8Weight):
        bits, qweight, scales, group_size, stride_s = 8, w.qweight, w.scales, BLOCK_K, 0  # group unused
    elif isinstance(w, Int4Weight) and w.layout == "nibbles":
        bits, qweight, scales, group_size, stride_s = 4, w.qweight, w.scale_zeros, w.group_size, w.scale_zeros.stride(0)
    else:
        raise ValueError(f"the Triton kernel reads int8 or nibbles-layout int4 weights, got {w!r:.60}")
    if group_size % BLOCK_K:
        raise ValueError(f"int4 group size {group_size} is not a multiple of the K tile {BLOCK_K}")
    config = matmul_config(x.shape[0], x.dtype)
    grid = (triton.cdiv(x.shape[0], config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]))
    _quant_matmul_kernel[grid](
        x, qweight, scales, y,
        x.shape[0], n, k, group_size,
        x.stride(0), qweight.stride(0), stride_s, y.stride(0),
        BITS=bits, DOT_FP32=_dot_fp32(x.dtype), **config.launch_kwargs(),
    )
    return y


def linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`kernels.quant.linear` on CUDA tensors (same Semantics)."""
    if x.shape[0] > CUDA_KERNEL_MAX_TOKENS:
        if isinstance(w, Int8Weight):
            dense = w.qweight.to(x.dtype) * w.scales[:, None]
        else:
            dense = dequantize_int4(nibble_values(w.qweight), w.scale_zeros, w.group_size, x.dtype)
        return F.linear(x, dense, bias)
    y = matmul(x.contiguous(), w)
    return y if bias is None else y.add_(bias)
