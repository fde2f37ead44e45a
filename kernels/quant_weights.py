"""Quantized matrices: int8 per output channel, int4 group-wise (the layouts; math in kernels.quant).

A quantized weight stands for the (N, K) = (out_features, in_features) matrix W the model would otherwise
hold in its activation dtype:

    int8:  W[n, k] = q[n, k] * scale[n]                              q in -127..127
    int4:  W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]         q in 0..15, g = k // group_size

(the int4 form of torch's packed CPU kernels and torchao; a GPTQ checkpoint's (q - z) * s is the same with
zero = (8 - z) * s). Scales and zeros are stored in the activation dtype, the form every kernel reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Int4Layout = Literal["nibbles", "cpu_int4pack", "panels", "quads"]


@dataclass(frozen=True)
class Int8Weight:
    """int8 per output channel (symmetric). `activations` says what the product reads x as:

    "float": x as it is (weight-only int8).
    "int8":  x rounded to int8 per row (token) at each call, sx[t] = max |x[t]| / 127 (W8A8 with dynamic
             per-token activation scales, as vLLM's and SGLang's int8 W8A8 schemes):
             y[t, n] = sum_k round(x[t, k] / sx[t]) * q[n, k] * sx[t] * scale[n] (kernels.quant.linear_ref).

    `layout` says how qweight holds q[n, k]:

    "rows":   (N, K) int8. Host form, and CUDA's.
    "panels": (ceil(N / 16), K / 2, 16, 2) int8, element [p, k2, j, t] = q[16 p + j, 2 k2 + t] (zero past N):
              the CPU's native kernel (kernels.dense_cpu's bf16 panel order, one byte per weight); with
              float32 scales (activations) (ceil(N / 16), K, 16), the fp32 panel order (the AVX2 kernel).
    "quads":  (ceil(N / 16), K / 4, 16, 4) uint8, element [p, k4, j, t] = q[16 p + j, 4 k4 + t] + 128 (128
              past N): the CPU's native int8 x int8 kernel (VNNI; AVX2), int8 activations only.
    """

    qweight: torch.Tensor
    scales: torch.Tensor  # (N,) activation dtype
    layout: Literal["rows", "panels", "quads"] = "rows"
    activations: Literal["float", "int8"] = "float"

    def __post_init__(self) -> None:
        if self.layout == "quads" and self.activations != "int8":
            raise ValueError("the quads layout is read with int8 activations only")

    @property
    def shape(self) -> tuple[int, int]:
        if self.layout == "panels":  # k pairs (bf16 activations) or single k (float32 activations)
            return (self.scales.shape[0], self.qweight.shape[1] * (2 if self.qweight.dim() == 4 else 1))
        if self.layout == "quads":
            return (self.scales.shape[0], self.qweight.shape[1] * 4)
        return (self.qweight.shape[0], self.qweight.shape[1])

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.qweight) + tensor_bytes(self.scales)


@dataclass(frozen=True)
class Int4Weight:
    """int4 group-wise (asymmetric). `activations` says what the product reads x as, as for Int8Weight:
    "float" (weight-only) or "int8" (x rounded to int8 per row at each call, W4A8:
    y[t, n] = sx[t] * sum_k round(x[t, k] / sx[t]) * W[n, k], kernels.quant.linear_ref).

    `layout` says how qweight holds the 4-bit values q[n, k]:

    "nibbles":      (N, K / 2) uint8, byte j of row n = q[n, 2j] | q[n, 2j + 1] << 4. Host form, and CUDA's.
    "cpu_int4pack": (N, K / 2) uint8 in the blocked layout of torch's `_convert_weight_to_int4pack_for_cpu`
                    (blocks of 64 or 32 rows, depending on the CPU; kernels.quant_cpu reads it back).
    "panels":       for the CPU's native kernels (scale_zeros (G, N, 2) as in the host form), in the activations' form:
                    bf16, (ceil(N / 16), K / 4, 32) uint8: byte e of [p, t] holds element e of k-pair 2t (low
                    nibble) and of k-pair 2t + 1 (high nibble), each k-pair's 32 elements in kernels.dense_cpu's
                    bf16 panel order; float32, single k (ceil(N / 16), K / 2, 16): byte [p, t, j] holds
                    q[16 p + j, 2t] (low nibble) and q[16 p + j, 2t + 1] (high).
    "quads":        (ceil(N / 16), K / 16, 4, 32) uint8, byte e of [p, b, t] holds q[16 p + e // 4, 16 b + 4 t +
                    e % 4] (low nibble) and q[16 p + 8 + e // 4, the same k] (high), zero past N: the CPU's
                    native int4 x int8 kernel (AVX2), int8 activations only. Its scale_zeros are panel-major,
                    (ceil(N / 16), G, 2, 16) (kernels.quant_cpu.pack_quads_scale_zeros), and `columns` is N.
    """

    qweight: torch.Tensor
    scale_zeros: torch.Tensor  # (K / group_size, N, 2) activation dtype: [..., 0] scale, [..., 1] zero (quads: above)
    group_size: int
    layout: Int4Layout = "nibbles"
    activations: Literal["float", "int8"] = "float"
    columns: int = 0  # N, for the quads layout (its scale_zeros are padded to whole panels)

    def __post_init__(self) -> None:
        if self.layout == "quads" and self.activations != "int8":
            raise ValueError("the int4 quads layout is read with int8 activations only")
        if self.layout == "quads" and (self.scale_zeros.dim() != 4 or self.columns <= 0):
            raise ValueError("int4 quads take panel-major (P, G, 2, 16) scale_zeros and their column count")

    @property
    def shape(self) -> tuple[int, int]:
        if self.layout == "panels":  # k-pair panels hold 4 k a byte row of 32, single-k panels 2 in one of 16
            return (self.scale_zeros.shape[1], (2 if self.qweight.shape[2] == 16 else 4) * self.qweight.shape[1])
        if self.layout == "quads":
            return (self.columns, 16 * self.qweight.shape[1])
        return (self.qweight.shape[0], 2 * self.qweight.shape[1])

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.qweight) + tensor_bytes(self.scale_zeros)


QuantizedWeight = Int8Weight | Int4Weight


def nibble_values(packed: torch.Tensor) -> torch.Tensor:
    """(N, K / 2) nibbles-layout bytes -> (N, K) uint8 values."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.shape[0], -1)


def dequantize_int4(q: torch.Tensor, scale_zeros: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """(N, K) values q and (G, N, 2) scales/zeros -> the (N, K) matrix, computed in `dtype`."""
    n, k = q.shape
    groups = q.to(dtype).reshape(n, k // group_size, group_size)  # (N, G, gs)
    sz = scale_zeros.to(dtype).transpose(0, 1)  # (N, G, 2)
    return ((groups - 8) * sz[..., :1] + sz[..., 1:]).view(n, k)


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
