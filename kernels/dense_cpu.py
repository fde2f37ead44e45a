"""Dense projection weights prepacked once at load for the CPU's fast kernels.

torch's `F.linear` on the CPU hands an (N, K) weight to MKL/oneDNN as a transposed operand every call, and
for the few-row products of decode (M = 1 .. 32) that path streams the weight at a fraction of what the
memory allows. Two packed layouts replace it:

- **Panels, where the native ops are built** (kernels/native_cpu.py; AVX-512, and AVX512-BF16 for
  bfloat16): loraplex's own layout of 16 output columns per panel, K pairs per 64-byte load for bf16 (the
  operand layout of VDPBF16PS) and single k for fp32, run by `bf16_linear` / `f32_linear`. On the bench
  model's 120 distinct projections (streamed from memory, not cache), 2 threads, the 2-core AVX-512 +
  bf16 development machine, one-off timings against oneDNN's packed layout: bf16 M=1 9.0 ms vs 16.6,
  M=8 8.5 vs 12.9, M=32 23 vs 25-27, M=64 37 vs 44-46, M=512 276-281 vs 272-284 (even); fp32 M=1 15.2
  vs 25.3, M=8 19.4 vs 24.2, M=32 44.9 vs 50.6, M=128 141 vs 171, M=512 557 vs 579. Results differ from
  F.linear's by the summation order (a one-off check, 32 x 576 -> 3072: fp32 at most 1e-6 of the
  largest output; bf16 0.006 % of outputs one rounding step apart). A tied embedding table packed this way still has row access (`rows`).
- **Elsewhere, float32, and bfloat16 where oneDNN has native bf16**: oneDNN's inner-product primitive
  over a weight reordered into its blocked layout (what Inductor's CPU freezing pass does): one thread,
  fp32 M=8 39 ms vs F.linear's 67, M=512 1.11 s vs 1.48 s; bf16 results equal F.linear's bit for bit.

Either packed tensor is opaque to other code: `unpack` gives the (N, K) matrix back for whoever needs the
values (the dequantized state dict, tests).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kernels import native_cpu

PREPACK_ENV = "LORAPLEX_CPU_PREPACK"  # "0" keeps plain F.linear (for A/B measurements)
PANEL = 16  # output columns per panel of the bf16 layout


@dataclass(frozen=True)
class PackedDense:
    """An (N, K) dense weight in one of the packed layouts. CPU only."""

    packed: torch.Tensor  # "onednn": opaque mkldnn tensor; "panels": bf16 (P, K / 2, 16, 2), fp32 (P, K, 16)
    shape: tuple[int, int]
    dtype: torch.dtype
    layout: Literal["onednn", "panels"] = "onednn"

    @property
    def nbytes(self) -> int:
        """Resident bytes: the matrix's (the panels' zero padding to 16 columns included)."""
        if self.layout == "panels":
            return self.packed.numel() * self.packed.element_size()
        return self.shape[0] * self.shape[1] * torch.empty((), dtype=self.dtype).element_size()


def can_pack(w: torch.Tensor) -> bool:
    """Whether `w` should be packed: a 2-D CPU weight in a dtype one of the packed kernels runs natively."""
    if os.environ.get(PREPACK_ENV, "1") == "0" or w.device.type != "cpu" or w.dim() != 2:
        return False
    return _panel_kernel(w) is not None or _onednn_can_pack(w)


def _panel_kernel(w: torch.Tensor) -> Any | None:  # the native ops if `w` goes to panels, else None
    if w.dtype not in (torch.float32, torch.bfloat16) or (w.dtype == torch.bfloat16 and w.shape[1] % 2):
        return None
    ops = native_cpu.available_for(w)
    if ops is None:
        return None
    return ops if (ops.has_bf16_linear() if w.dtype == torch.bfloat16 else ops.has_f32_linear()) else None


def has_row_access(w: torch.Tensor) -> bool:
    """Whether `w` would be packed into a layout `rows` reads directly (panels): a tied embedding
    table can then be packed for its lm_head and stay one copy."""
    return can_pack(w) and _panel_kernel(w) is not None


def _onednn_can_pack(w: torch.Tensor) -> bool:
    """oneDNN runs fp32 natively, and bf16 only where it has native bf16 (avx512_bf16 / AMX)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if w.dtype == torch.float32:
        return True
    return w.dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


_BF16_LINEAR: Any = None  # the native ops' overloads, bound when the first panels are made
_F32_LINEAR: Any = None
_INT8_LINEAR: Any = None
_INT4_LINEAR: Any = None
_W8A8_LINEAR: Any = None
_W4A8_LINEAR: Any = None


def _bind(ops: Any) -> None:
    global _BF16_LINEAR, _F32_LINEAR, _INT8_LINEAR, _INT4_LINEAR, _W8A8_LINEAR, _W4A8_LINEAR
    _BF16_LINEAR, _F32_LINEAR, _INT8_LINEAR = ops.bf16_linear.default, ops.f32_linear.default, ops.int8_linear.default
    _W8A8_LINEAR, _W4A8_LINEAR = ops.w8a8_linear.default, ops.w4a8_linear.default
    _INT4_LINEAR = ops.int4_linear.default


def pack(w: torch.Tensor) -> PackedDense:
    """Pack (N, K) `w` once: panels where the native kernel runs (can_pack), else oneDNN's layout (no
    batch-size hint: one layout serves every M)."""
    w = w.contiguous()
    n, k = w.shape
    ops = _panel_kernel(w)
    if ops is not None:
        _bind(ops)
        return PackedDense(panel(w), (n, k), w.dtype, "panels")
    return PackedDense(torch.ops.mkldnn._reorder_linear_weight(w, None), (n, k), w.dtype)


def panel(w: torch.Tensor, pairs: bool | None = None) -> torch.Tensor:
    """(N, K) -> panels of 16 rows, zero-padded past N: with k pairs (the default for 2-byte and 1-byte
    types, bf16 and int8) as (P, K / 2, 16, 2), 16 columns x 2 consecutive k per load; single k (the
    default for fp32, and int8 read with fp32 activations) as (P, K, 16)."""
    n, k = w.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=w.dtype, device=w.device)
    padded[:n] = w
    if not (w.dtype != torch.float32 if pairs is None else pairs):
        return padded.view(-1, PANEL, k).permute(0, 2, 1).contiguous()
    return padded.view(-1, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpanel(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The (N, K) matrix of `panel`'s output."""
    if panels.dim() == 3:  # single k (fp32, and int8 for fp32 activations)
        return panels.permute(0, 2, 1).reshape(-1, panels.shape[1])[:n].contiguous()
    return panels.permute(0, 2, 1, 3).reshape(-1, panels.shape[1] * 2)[:n].contiguous()


def can_pack_int8(q: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether an int8 (N, K) weight goes to int8 panels: on the CPU, with bf16 scales (activations), an
    even K and the native bf16 kernel built (K-pair panels), or with float32 scales and the native AVX2
    kernel built (single-k panels: `panel(q, pairs=False)`)."""
    if q.device.type != "cpu":
        return False
    if scales.dtype == torch.bfloat16:
        return bf16_panels_ready(q.shape[1])
    if scales.dtype != torch.float32 or os.environ.get(PREPACK_ENV, "1") == "0":
        return False
    ops = native_cpu.available_for(torch.empty(0, q.shape[1]))
    if ops is None or not ops.has_int8_linear_f32():
        return False
    _bind(ops)
    return True


def can_pack_int4_f32(k: int, group_size: int) -> bool:
    """Whether int4 weights of K inputs with float32 scales (activations) go to single-k int4 panels: groups of
    a multiple of 8 inputs, prepacking on and the native AVX2 kernel built (`int4_linear` with float32 x)."""
    if os.environ.get(PREPACK_ENV, "1") == "0" or k % 2 or group_size % 8:
        return False
    ops = native_cpu.available_for(torch.empty(0, k))
    if ops is None or not ops.has_int4_linear_f32():
        return False
    _bind(ops)
    return True


def can_pack_w8a8(q: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether an int8 (N, K) weight with int8 activations goes to the native quads: on the CPU, K a
    multiple of 16, prepacking on, and a native int8 kernel built for the scales' (activations') dtype:
    AVX512-VNNI (bf16) or AVX2 (bf16 and float32)."""
    if q.device.type != "cpu" or scales.dtype not in (torch.bfloat16, torch.float32) or q.shape[1] % 16:
        return False
    if os.environ.get(PREPACK_ENV, "1") == "0":
        return False
    ops = native_cpu.available_for(torch.empty(0, q.shape[1], dtype=scales.dtype))
    if ops is None or not (ops.has_w8a8_linear() if scales.dtype == torch.bfloat16 else ops.has_w8a8_linear_f32()):
        return False
    _bind(ops)
    return True


def can_pack_w4a8(k: int, group_size: int, dtype: torch.dtype) -> bool:
    """Whether int4 weights of K inputs with int8 activations and scales in `dtype` (bf16 or float32) go to
    the native int4 quads (kernels.quant_cpu.pack_int4_quads): groups of a multiple of 32 inputs, prepacking
    on and the native kernel built (`w4a8_linear`: AVX2 builds, AVX512-VNNI products where the CPU has them)."""
    if dtype not in (torch.bfloat16, torch.float32) or k % group_size or group_size % 32:
        return False
    if os.environ.get(PREPACK_ENV, "1") == "0":
        return False
    ops = native_cpu.available_for(torch.empty(0, k, dtype=dtype))
    if ops is None or not ops.has_w4a8_linear():
        return False
    _bind(ops)
    return True


def quads(q: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 -> (P, K / 4, 16, 4) uint8 of q + 128, 128 (q = 0) past N: 16 columns x 4 consecutive k
    per 64-byte load, the unsigned operand of VPDPBUSD."""
    n, k = q.shape
    padded = torch.full((-(-n // PANEL) * PANEL, k), 128, dtype=torch.uint8, device=q.device)
    padded[:n] = (q.to(torch.int16) + 128).to(torch.uint8)
    return padded.view(-1, PANEL, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def unquads(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The (N, K) int8 matrix of `quads`' output."""
    rows = packed.permute(0, 2, 1, 3).reshape(-1, packed.shape[1] * 4)[:n]
    return (rows.to(torch.int16) - 128).to(torch.int8)


def bf16_panels_ready(k: int) -> bool:
    """Whether quantized weights of K inputs go to native panels read with bf16 activations: prepacking on
    (LORAPLEX_CPU_PREPACK) and the native bf16 panel kernel built for this CPU."""
    if os.environ.get(PREPACK_ENV, "1") == "0":
        return False
    ops = _panel_kernel(torch.empty(0, k, dtype=torch.bfloat16))
    if ops is not None:
        _bind(ops)
    return ops is not None


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = (x @ q.T) * scales + bias over int8 panels (k pairs for bf16 x, single k for float32 x, as the scales): q
    widened to x's dtype exactly in registers, fp32 sums.

    Semantics: the reference is F.linear(x.float(), unpanel(qweight) * scales[:, None], bias), in x's dtype.
    """
    assert _INT8_LINEAR is not None, "int8 panels are only made where the native ops run"
    if x.dim() == 2 and x.stride(1) == 1 and bias is None:
        return _INT8_LINEAR(x, qweight, scales, None)
    x2, b = _rows(x, qweight.shape[1] * (2 if qweight.dim() == 4 else 1)), _bias(bias)
    return _INT8_LINEAR(x2, qweight, scales, b).view(*x.shape[:-1], scales.shape[0])


def w8a8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = (round_rows_int8(x) @ q.T) * scales + bias over quads (x bf16, or float32 on AVX2 builds): each
    row of x rounded to int8 here (kernels.quant.round_rows_int8), exact int32 sums, one fp32 scaling, y in
    x's dtype.

    Semantics: the reference is kernels.quant.linear_ref of an int8-activation Int8Weight.
    """
    assert _W8A8_LINEAR is not None, "quads are only made where the native ops run"
    x2, b = _rows(x, qweight.shape[1] * 4), _bias(bias)
    return _W8A8_LINEAR(x2, qweight, scales, b).view(*x.shape[:-1], scales.shape[0])


def w4a8_linear(x: torch.Tensor, qweight: torch.Tensor, scale_zeros: torch.Tensor, n: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T + bias over int4 quads (kernels.quant_cpu.pack_int4_quads) of N = n columns with their
    scales and zeros in panel-major form (kernels.quant_cpu.pack_quads_scale_zeros) in x's dtype (bf16 or
    float32), x rounded to int8 per row here (kernels.quant.round_rows_int8): exact int32 sums of q * qx over
    each group, then fp32 as in the kernel's comment, y in x's dtype.

    Semantics: the reference is kernels.quant.linear_ref of an int8-activation Int4Weight.
    """
    assert _W4A8_LINEAR is not None, "int4 quads are only made where the native ops run"
    x2, b = _rows(x, qweight.shape[1] * 16), _bias(bias)
    return _W4A8_LINEAR(x2, qweight, scale_zeros, n, b).view(*x.shape[:-1], n)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scale_zeros: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T + bias over int4 panels (kernels.quant_cpu.pack_int4_panels) with their (G, N, 2) scales
    and zeros in x's dtype: fp32 sums, the weights ((q - 8) * scale + zero) never rounded, y rounded once.
    bf16 x (k-pair panels): each group sums x * (128 + q) in bf16 dot products (128 + q is exact in bf16)
    and subtracts 136 * sum(x) before its scale. float32 x (single-k panels, AVX2 builds): each group sums
    x * q in fp32 FMAs, then adds scale * that + (zero - 8 * scale) * sum(x); the same operations at every
    batch size, so a row's result does not depend on the rows beside it.

    Semantics: the reference is F.linear(x.float(), dequantize(w) in fp32, bias), in x's dtype.
    """
    assert _INT4_LINEAR is not None, "int4 panels are only made where the native ops run"
    x2, b = _rows(x, qweight.shape[1] * (2 if qweight.shape[2] == PANEL else 4)), _bias(bias)
    return _INT4_LINEAR(x2, qweight, scale_zeros, b).view(*x.shape[:-1], scale_zeros.shape[1])


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x as (rows, K) with contiguous rows: the native kernels' activation operand."""
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.float().contiguous()


def linear(x: torch.Tensor, w: PackedDense, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T + bias through the packed weight's kernel.

    Semantics:
        y[t, n] = sum_k x[t, k] * W[n, k] + bias[n]   (the reference twin is F.linear(x, unpack(w), bias))
        x: (T, K) in w's dtype, bias: (N,) or None -> y: (T, N) in that dtype.
    """
    if w.layout == "panels" and x.dim() == 2 and x.stride(1) == 1 and bias is None and x.dtype == w.dtype:
        # the decode step's common case, with the fewest Python steps (120+ calls a step)
        return (_BF16_LINEAR if w.dtype == torch.bfloat16 else _F32_LINEAR)(x, w.packed, w.shape[0], None)
    if x.dtype != w.dtype:
        raise ValueError(f"x is {x.dtype} but the packed weight is {w.dtype}")
    if w.layout == "panels":
        ops = native_cpu.ops()
        assert ops is not None, "panels are only made where the native ops run"
        kernel = ops.bf16_linear if w.dtype == torch.bfloat16 else ops.f32_linear
        return kernel(_rows(x, w.shape[1]), w.packed, w.shape[0], _bias(bias)).view(*x.shape[:-1], w.shape[0])
    return torch.ops.mkldnn._linear_pointwise(x, w.packed, bias, "none", [], "")


def rows(w: PackedDense, ids: torch.Tensor) -> torch.Tensor:
    """W[ids]: (T,) row ids -> (T, K), an embedding lookup in a table packed for its tied lm_head.

    Semantics: F.embedding(ids, unpack(w)). Panels gather each row's K values from its panel column; a
    oneDNN-packed table has no row access, so it is unpacked (not made for a tied table)."""
    if w.layout == "panels":
        if w.dtype == torch.bfloat16:
            return w.packed[ids // PANEL, :, ids % PANEL, :].reshape(ids.shape[0], w.shape[1])
        return w.packed[ids // PANEL, :, ids % PANEL]
    return unpack(w)[ids]


def unpack(w: PackedDense) -> torch.Tensor:
    """The (N, K) matrix, as a plain tensor."""
    if w.layout == "panels":
        return unpanel(w.packed, w.shape[0])
    return w.packed.to_dense()
