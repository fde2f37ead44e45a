"""Quantized linear layers: int8 per output channel, int4 group-wise, weight-only (activations unquantized),
and int8 weights with int8 activations rounded per token (W8A8).

The matrices and their layouts are in kernels.quant_weights (W[n, k] = q[n, k] * scale[n] for int8,
(q[n, k] - 8) * scale[g, n] + zero[g, n] for int4). `linear(x, w, bias)` is the model's one entry for every
projection: a dense tensor goes to F.linear, a dense weight `place` prepacked for oneDNN on the CPU
(kernels.dense_cpu) to oneDNN's inner product; a quantized weight to Triton on CUDA (kernels.quant_triton)
and to the CPU path (kernels.quant_cpu: torch's packed kernels or dequantize-then-F.linear, chosen per call
by measured thresholds) otherwise. `linear_ref` is the torch reference twin the tests compare both against:
one fp32 matmul over `dequantize(w)`. Quantizing (`quantize_int8`, `quantize_int4`) happens once, at load,
on the host; `place` then moves a weight to its device in the layout that device's kernels read.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.nn.functional as F

from kernels import dense_cpu, quant_cpu
from kernels.dense_cpu import PackedDense
from kernels.quant_weights import (
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    dequantize_int4,
    nibble_values,
    tensor_bytes,
)

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's CPU kernel and the Triton kernel's K tiles support
Weight = torch.Tensor | QuantizedWeight | PackedDense  # what a model's projection holds
__all__ = ["INT4_GROUP_SIZES", "Int4Weight", "Int8Weight", "PackedDense", "QuantizedWeight", "Weight", "concat",
           "dequantize", "int4_from_values", "int4_scale_zeros", "int4_values", "linear", "linear_ref", "nbytes",
           "place", "quantize_int4", "quantize_int8", "round_rows_int8", "rows"]


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T + bias for a dense or quantized W.

    Semantics:
        y[t, n] = sum_k x[t, k] * W[n, k] + bias[n], W as in kernels.quant_weights (dense: the tensor itself).
        x: (T, K) activation dtype, bias: (N,) or None -> y: (T, N) in x's dtype. A quantized W is read in
        x's dtype (on the CPU, bf16 activations use torch's packed int8/int4 kernels or a bf16 dequantized
        copy; fp32 and fp16 a dequantized copy in their dtype; on CUDA the Triton kernel sums in fp32), so y
        agrees with `linear_ref` to that dtype's rounding. An int8 or int4 W with int8 activations (W8A8,
        W4A8) reads x rounded to int8 per row instead (kernels.quant_weights; the CPU's native integer
        kernels on quads, else the rounded rows through the weight-only path).
    """
    if isinstance(w, PackedDense):
        return dense_cpu.linear(x, w, bias)
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    if x.dtype != _scales(w).dtype:
        raise ValueError(f"x is {x.dtype} but the quantized weight's scales are {_scales(w).dtype}")
    if w.activations == "int8" and w.layout != "quads":
        # No integer kernel for this layout: the rounded rows (integers, exact in any float dtype)
        # through the weight-only kernel, then each row's scale.
        qx, sx = round_rows_int8(x)
        y = _weight_only(qx.to(x.dtype), dataclasses.replace(w, activations="float"), None).float() * sx[..., None]
        return (y if bias is None else y + bias.float()).to(x.dtype)
    return _weight_only(x, w, bias)


def _weight_only(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if x.is_cuda:
        from kernels import quant_triton

        return quant_triton.linear(x, w, bias)
    return quant_cpu.linear(x, w, bias)


def linear_ref(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference twin of `linear` (same Semantics): an fp32 matmul over `dequantize(w)` (and, for
    int8 activations, over `round_rows_int8(x)` dequantized; exact integer sums, in float64)."""
    if isinstance(w, Int8Weight) and w.activations == "int8":
        qx, sx = round_rows_int8(x)
        acc = (qx.double() @ int8_rows(w).double().T).float()
        y = acc * (sx[:, None] * w.scales.float()[None, :])
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)
    if w.activations == "int8":
        qx, sx = round_rows_int8(x)
        y = (qx.double() @ dequantize(w, torch.float64).T).float() * sx[:, None]
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)
    y = x.float() @ dequantize(w).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def dequantize(w: QuantizedWeight | PackedDense, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (N, K) matrix w stands for, computed in `dtype` (fp32: exactly the module docstring's formula)."""
    if isinstance(w, PackedDense):
        return dense_cpu.unpack(w).to(dtype)
    if isinstance(w, Int8Weight):
        return int8_rows(w).to(dtype) * w.scales.to(dtype)[:, None]
    return dequantize_int4(int4_values(w), int4_scale_zeros(w), w.group_size, dtype)


def int8_rows(w: Int8Weight) -> torch.Tensor:
    """(N, K) int8: the values q[n, k] of w, whatever its layout."""
    if w.layout == "quads":
        return dense_cpu.unquads(w.qweight, w.shape[0])
    return dense_cpu.unpanel(w.qweight, w.shape[0]) if w.layout == "panels" else w.qweight


def rows(w: Int8Weight, ids: torch.Tensor) -> torch.Tensor:
    """W[ids]: (T,) row ids -> (T, K) in the scales' dtype, an embedding lookup in an int8 table (a tied
    lm_head's). Semantics: dequantize(w, scales' dtype)[ids], read from the rows' own bytes in any layout."""
    qw, n = w.qweight, ids.shape[0]
    if w.layout == "panels":  # (P, K, 16) single k, or (P, K / 2, 16, 2) k pairs
        p, j = ids // dense_cpu.PANEL, ids % dense_cpu.PANEL
        q = (qw[p, :, j] if qw.dim() == 3 else qw[p, :, j, :]).reshape(n, w.shape[1])
    elif w.layout == "quads":  # (P, K / 4, 16, 4) uint8, q + 128
        p, j = ids // dense_cpu.PANEL, ids % dense_cpu.PANEL
        q = (qw[p, :, j, :].reshape(n, w.shape[1]).to(torch.int16) - 128).to(torch.int8)
    else:
        q = qw[ids]
    dtype = w.scales.dtype
    return q.to(dtype) * w.scales[ids].to(dtype)[:, None]


def round_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of (T, K) x rounded to int8 with its own scale: qx = rne(x * (127 / max |x[t]|)) in -127..127
    (all-zero rows: 0) and sx[t] = max |x[t]| / 127, so x ~ qx * sx. fp32, in the native kernel's order of
    operations (one division, one product, one rounding), so both give the same qx: (qx float32, sx)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return torch.round(xf * inv[..., None]), amax / 127


def int4_scale_zeros(w: Int4Weight) -> torch.Tensor:
    """(G, N, 2) scales and zeros of w, whatever its layout (the quads hold them panel-major)."""
    if w.layout == "quads":
        return quant_cpu.unpack_quads_scale_zeros(w.scale_zeros, w.shape[0])
    return w.scale_zeros


def int4_values(w: Int4Weight) -> torch.Tensor:
    """(N, K) uint8: the 4-bit values q[n, k] of w, whatever its layout."""
    if w.layout == "cpu_int4pack":
        return quant_cpu.unpack_int4(w.qweight, w.shape[0], w.shape[1]).T
    if w.layout == "panels":
        return quant_cpu.unpack_int4_panels(w.qweight, w.shape[0])
    if w.layout == "quads":
        return quant_cpu.unpack_int4_quads(w.qweight, w.shape[0])
    return nibble_values(w.qweight)


def quantize_int8(w: torch.Tensor, dtype: torch.dtype, activations: Literal["float", "int8"] = "float") -> Int8Weight:
    """Round (N, K) w to int8 with one scale per row: scale = max |w[n]| / 127, stored in `dtype`;
    `activations`: what the product reads x as (kernels.quant_weights.Int8Weight)."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float16).tiny).to(dtype)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scales, activations=activations)


def quantize_int4(w: torch.Tensor, group_size: int, dtype: torch.dtype,
                  activations: Literal["float", "int8"] = "float") -> Int4Weight:
    """Round (N, K) w to int4 per group of `group_size` inputs (min-max, asymmetric), nibbles layout;
    `activations`: what the product reads x as (kernels.quant_weights.Int4Weight).

    Each group's [min, max] maps onto 0..15: scale = (max - min) / 15, zero = min + 8 * scale, both stored
    in `dtype`; q = round((w - zero) / scale) + 8 against the stored (rounded) scale and zero.
    """
    n, k = w.shape
    _check_group(k, group_size)
    groups = w.float().view(n, k // group_size, group_size)  # (N, G, gs)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float16).tiny).to(dtype)
    zeros = (lo + 8 * scales.float()).to(dtype)
    q = torch.round((groups - zeros.float()[..., None]) / scales.float()[..., None]) + 8
    return int4_from_values(q.clamp(0, 15).to(torch.uint8).view(n, k), scales.T, zeros.T, group_size, activations)


def int4_from_values(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                     activations: Literal["float", "int8"] = "float") -> Int4Weight:
    """An Int4Weight (nibbles layout) from values q (N, K) in 0..15 and scales, zeros (K / group_size, N)."""
    n, k = q.shape
    _check_group(k, group_size)
    if tuple(scales.shape) != (k // group_size, n) or scales.shape != zeros.shape:
        raise ValueError(f"scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not fit q {(n, k)} "
                         f"with group size {group_size}")
    q = q.to(torch.uint8)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)  # (N, K / 2)
    return Int4Weight(packed.contiguous(), torch.stack([scales, zeros], dim=-1).contiguous(), group_size,
                      activations=activations)


def concat(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack quantized weights along N (the fused q|k|v and gate|up projections). Host layouts only."""
    int8 = [w for w in weights if isinstance(w, Int8Weight) and w.layout == "rows"]
    if len(int8) == len(weights) and len({w.activations for w in int8}) == 1:
        return Int8Weight(torch.cat([w.qweight for w in int8]), torch.cat([w.scales for w in int8]),
                          activations=int8[0].activations)
    int4 = [w for w in weights if isinstance(w, Int4Weight) and w.layout == "nibbles"]
    if len(int4) == len(weights) and len({(w.group_size, w.activations) for w in int4}) == 1:
        return Int4Weight(torch.cat([w.qweight for w in int4]), torch.cat([w.scale_zeros for w in int4], 1),
                          int4[0].group_size, activations=int4[0].activations)
    raise ValueError("only quantized weights of one kind, group size and nibbles layout can be fused")


def place(w: Weight, device: torch.device | str) -> Weight:
    """w on `device` in the layout its kernels read: a dense CPU weight is prepacked (kernels.dense_cpu: the
    native panels, or oneDNN's layout); int8 and int4 with bf16 scales go to the native int8 / int4 panels
    where the native bf16 kernel runs, int8 and int4 with float32 scales to single-k panels where the AVX2
    kernels run;
    else int4 goes to torch's CPU layout where that kernel exists and N is a multiple of 16 (else it stays
    in nibbles and is dequantized per call). int8 with int8 activations goes to the native quads where a
    native int8 x int8 kernel reads the scales' dtype (VNNI, AVX2), else stays in rows; int4 with int8
    activations to the native int4 quads where the int4 x int8 kernel runs (AVX2 builds), else as weight-only int4
    (its rounded rows run through that path: `linear`)."""
    device = torch.device(device)
    if isinstance(w, PackedDense):
        w = dense_cpu.unpack(w)
    if isinstance(w, torch.Tensor):
        w = w.to(device)
        return dense_cpu.pack(w) if dense_cpu.can_pack(w) else w
    if isinstance(w, Int8Weight):
        q = int8_rows(w).to(device)
        if w.activations == "int8" and dense_cpu.can_pack_w8a8(q, w.scales):
            return Int8Weight(dense_cpu.quads(q), w.scales.contiguous(), "quads", "int8")
        if w.activations == "float" and dense_cpu.can_pack_int8(q, w.scales):
            pairs = w.scales.dtype == torch.bfloat16  # fp32 activations read single-k panels
            return Int8Weight(dense_cpu.panel(q, pairs), w.scales.contiguous(), "panels")
        return Int8Weight(q, w.scales.to(device), activations=w.activations)
    if w.layout == "quads":  # back to the host form first; it may go to other quads or another layout
        sz = int4_scale_zeros(w)
        w = int4_from_values(int4_values(w), sz[..., 0], sz[..., 1], w.group_size, w.activations)
    cpu = device.type == "cpu" and w.layout == "nibbles"
    if cpu and w.activations == "int8" and dense_cpu.can_pack_w4a8(w.shape[1], w.group_size, w.scale_zeros.dtype):
        return Int4Weight(quant_cpu.pack_int4_quads(int4_values(w)), quant_cpu.pack_quads_scale_zeros(w.scale_zeros),
                          w.group_size, "quads", "int8", w.shape[0])
    if cpu and quant_cpu.can_pack_int4_panels(w):
        single_k = w.scale_zeros.dtype == torch.float32  # float32 activations read single-k panels
        return Int4Weight(quant_cpu.pack_int4_panels(int4_values(w), single_k), w.scale_zeros.contiguous(),
                          w.group_size, "panels", w.activations)
    if cpu and quant_cpu.can_pack_int4(w.shape[0]):
        return Int4Weight(quant_cpu.pack_int4(int4_values(w)), w.scale_zeros.contiguous(), w.group_size,
                          "cpu_int4pack", w.activations)
    if device.type != "cpu" and w.layout != "nibbles":
        w = int4_from_values(int4_values(w), w.scale_zeros[..., 0], w.scale_zeros[..., 1], w.group_size,
                             w.activations)
    return Int4Weight(w.qweight.to(device), w.scale_zeros.to(device), w.group_size, w.layout, w.activations)


def nbytes(w: Weight) -> int:
    """Resident bytes of a dense, packed or quantized weight."""
    return tensor_bytes(w) if isinstance(w, torch.Tensor) else w.nbytes


def _scales(w: QuantizedWeight) -> torch.Tensor:
    return w.scales if isinstance(w, Int8Weight) else w.scale_zeros


def _check_group(in_features: int, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if in_features % group_size:
        raise ValueError(f"int4 group size {group_size} does not divide in_features {in_features}")
