"""The CPU path of `kernels.quant.linear`: torch's packed int8/int4 kernels, or dequantize then F.linear.

Per call, by measurement (python -m bench.quantization; single thread, AMD EPYC with AVX-512 BF16, the bench
model's shapes, torch 2.13):

- bf16 activations, few tokens: `torch.ops.aten._weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu`
  read 1 or 0.5 byte per weight and beat bf16 F.linear 1.4-2.5x at one token (fused q|k|v 960x576: 31-35 us
  vs 58-67 us; gate|up 3072x576: 95-108 us vs 140-240 us). They do not reuse a weight tile across more than
  4 rows, so their cost grows linearly with tokens: from 17 tokens (int8) and 33 (int4) on, dequantizing the
  weight to bf16 and calling F.linear wins (at 512 tokens the packed kernels take 1.9-2.6x as long as that;
  the dequantized path is 5-20 % slower than bf16 F.linear there).
- fp32 and fp16 activations: the packed kernels have no vectorized path for them (fp32: 10-100x slower
  than fp32 F.linear; fp16 int8: 1740 us vs 95 us in bf16 on gate|up), so the weight is dequantized to the
  activation dtype and F.linear runs it (one extra pass over the weight per call).
- a kernel missing from this torch build: dequantize then F.linear, whatever the dtype.

Where the native kernels are built (kernels.dense_cpu), weights placed into their panels skip all of the
above: int8 and int4 panels for bf16 activations (AVX512-BF16), single-k int8 and int4 panels for float32
activations (AVX2), int8 quads for w8a8, int4 quads for w4a8 (AVX2, with AVX512-VNNI products where the CPU has them).

torch's int4 layout is blocked (64 rows per block with AVX-512, 32 otherwise; the pairing of rows in a byte
depends on the CPU capability), so `unpack_int4` reads it back through the row order it probes from the
packing op itself, once per block size, on this machine.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels import dense_cpu
from kernels.quant_weights import Int4Weight, Int8Weight, QuantizedWeight, nibble_values

_aten = torch.ops.aten
HAS_INT8_MM = hasattr(_aten, "_weight_int8pack_mm")
HAS_INT4_MM = hasattr(_aten, "_weight_int4pack_mm_for_cpu") and hasattr(_aten, "_convert_weight_to_int4pack_for_cpu")
# Up to this many tokens the packed kernel runs; above it, dequantize then F.linear (measured; see above).
INT8_PACKED_MAX_TOKENS = 16
INT4_PACKED_MAX_TOKENS = 32
_INNER_K_TILES = 8  # ignored by the CPU kernel, which packs by rows; 8 is what torchao passes


def linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`kernels.quant.linear` on CPU tensors (same Semantics)."""
    tokens = x.shape[0]
    bf16 = x.dtype == torch.bfloat16
    if isinstance(w, Int8Weight):
        if w.layout == "quads":  # int8 activations, where a native kernel reads x's dtype (kernels.quant.place)
            return dense_cpu.w8a8_linear(x, w.qweight, w.scales, bias)
        if w.layout == "panels":  # made for the scales' dtype (kernels.quant.place)
            return dense_cpu.int8_linear(x, w.qweight, w.scales, bias)
        if bf16 and HAS_INT8_MM and tokens <= INT8_PACKED_MAX_TOKENS:
            return _add_bias(_aten._weight_int8pack_mm(x.contiguous(), w.qweight, w.scales), bias)
        return F.linear(x, w.qweight.to(x.dtype) * w.scales[:, None], bias)
    if w.layout == "quads":  # int8 activations, where the native kernel runs (kernels.quant.place)
        return dense_cpu.w4a8_linear(x, w.qweight, w.scale_zeros, w.shape[0], bias)
    if w.layout == "panels":  # made for the scales' dtype (kernels.quant.place)
        return dense_cpu.int4_linear(x, w.qweight, w.scale_zeros, bias)
    if bf16 and w.layout == "cpu_int4pack" and tokens <= INT4_PACKED_MAX_TOKENS:
        return _add_bias(_aten._weight_int4pack_mm_for_cpu(x.contiguous(), w.qweight, w.group_size, w.scale_zeros),
                         bias)
    y = x @ dequantize_int4_t(w, x.dtype)
    return _add_bias(y, bias)


def dequantize_int4_t(w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """W.T (K, N) in `dtype`, contiguous: the operand of x @ W.T without a transpose copy of the weight.

    q - 8 is unpacked straight into `dtype` in W.T's order, then one addcmul adds zero + (q - 8) * scale,
    computed in fp32 and rounded once (torch's CPU ops on bf16), like the reference.
    """
    n, k = w.shape
    if w.layout == "cpu_int4pack":
        centered = unpack_int4(w.qweight, n, k, dtype, offset=8)  # (K, N)
    else:
        centered = (nibble_values(w.qweight).T.to(dtype, memory_format=torch.contiguous_format) - 8)
    scales, zeros = w.scale_zeros[..., 0].contiguous(), w.scale_zeros[..., 1].contiguous()  # (G, N) each
    groups = k // w.group_size
    return torch.addcmul(zeros[:, None, :], centered.view(groups, w.group_size, n), scales[:, None, :]).view(k, n)


def pack_int4_panels(q: torch.Tensor, single_k: bool = False) -> torch.Tensor:
    """(N, K) values in 0..15 -> the native kernel's int4 panels (kernels.quant_weights, layout "panels";
    the kernel reads the scales and zeros from scale_zeros as stored), zero past N. For bf16 activations
    (P, K / 4, 32): byte e of [p, t] holds element e of k pair 2t (low nibble) and of k pair 2t + 1 (high),
    each k pair's 32 elements in the bf16 panels' order (16 columns x 2 k). `single_k`, for float32
    activations: (P, K / 2, 16), byte [p, t, j] = q[16 p + j, 2 t] | q[16 p + j, 2 t + 1] << 4."""
    n, k = q.shape
    panels = -(-n // dense_cpu.PANEL)
    padded = torch.zeros(panels * dense_cpu.PANEL, k, dtype=torch.uint8)
    padded[:n] = q
    if single_k:
        pairs = padded.view(panels, dense_cpu.PANEL, k // 2, 2).permute(0, 2, 1, 3)  # (P, K / 2, 16, 2)
        return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
    pairs = padded.view(panels, dense_cpu.PANEL, k // 4, 2, 2).permute(0, 2, 3, 1, 4).reshape(panels, k // 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).contiguous()


def pack_int4_quads(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values in 0..15 -> the native int4 x int8 kernel's quads (kernels.quant_weights, layout
    "quads"), (P, K / 16, 4, 32): byte [p, k // 16, k % 16 // 4, 4 c + k % 4] = q[16 p + c, k] | q[16 p + 8 + c,
    k] << 4 for c in 0..7, zero past N."""
    n, k = q.shape
    panels = -(-n // dense_cpu.PANEL)
    padded = torch.zeros(panels * dense_cpu.PANEL, k, dtype=torch.uint8)
    padded[:n] = q
    halves = padded.view(panels, 2, 8, k // 4, 4).permute(0, 3, 1, 2, 4).reshape(panels, k // 4, 2, 32)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).view(panels, k // 16, 4, 32).contiguous()


def unpack_int4_quads(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The (N, K) values of `pack_int4_quads`'s quads."""
    panels, blocks = packed.shape[:2]
    halves = torch.stack([packed & 15, packed >> 4], dim=3).view(panels, blocks * 4, 2, 8, 4)  # (P, K / 4, 2, 8, 4)
    return halves.permute(0, 2, 3, 1, 4).reshape(panels * dense_cpu.PANEL, blocks * 16)[:n].contiguous()


def pack_quads_scale_zeros(scale_zeros: torch.Tensor) -> torch.Tensor:
    """(G, N, 2) scales and zeros -> the quads' panel-major form (P, G, 2, 16): [p, g, 0, j] = scale and [p, g,
    1, j] = zero of column 16 p + j in group g, zero past N. A panel's terms then sit in one G x 32 block the
    kernel streams beside the panel's quads (in (G, N, 2) order each group's 16 columns were two lines far
    from the next group's)."""
    groups, n, _ = scale_zeros.shape
    panels = -(-n // dense_cpu.PANEL)
    padded = torch.zeros(groups, panels * dense_cpu.PANEL, 2, dtype=scale_zeros.dtype, device=scale_zeros.device)
    padded[:, :n] = scale_zeros
    return padded.view(groups, panels, dense_cpu.PANEL, 2).permute(1, 0, 3, 2).contiguous()


def unpack_quads_scale_zeros(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The (G, N, 2) scales and zeros of `pack_quads_scale_zeros`'s output."""
    panels, groups = packed.shape[:2]
    return packed.permute(1, 0, 3, 2).reshape(groups, panels * dense_cpu.PANEL, 2)[:, :n].contiguous()


def unpack_int4_panels(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The (N, K) values of `pack_int4_panels`'s panels (either kind: single-k panels hold 16 bytes a k pair)."""
    panels, steps, width = packed.shape
    if width == dense_cpu.PANEL:  # single k: (P, K / 2, 16)
        pairs = torch.stack([packed & 15, packed >> 4], dim=3)  # (P, K / 2, 16, 2)
        return pairs.permute(0, 2, 1, 3).reshape(panels * dense_cpu.PANEL, 2 * steps)[:n].contiguous()
    pairs = torch.stack([packed & 15, packed >> 4], dim=2)  # (P, K / 4, 2, 32)
    q = pairs.view(panels, steps, 2, dense_cpu.PANEL, 2).permute(0, 3, 1, 2, 4).reshape(panels * dense_cpu.PANEL,
                                                                                         4 * steps)
    return q[:n].contiguous()


def can_pack_int4_panels(w: Int4Weight) -> bool:
    """Whether an int4 weight goes to the native panels: on the CPU, with bf16 scales (activations), K a
    multiple of 4 and the native bf16 kernel built (k-pair panels), or with float32 scales and the native AVX2
    kernel built (single-k panels: `pack_int4_panels(q, single_k=True)`)."""
    if w.qweight.device.type != "cpu":
        return False
    if w.scale_zeros.dtype == torch.float32:
        return dense_cpu.can_pack_int4_f32(w.shape[1], w.group_size)
    return w.scale_zeros.dtype == torch.bfloat16 and w.shape[1] % 4 == 0 and dense_cpu.bf16_panels_ready(w.shape[1])


def can_pack_int4(out_features: int) -> bool:
    return HAS_INT4_MM and out_features % 16 == 0


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values in 0..15 -> torch's CPU int4 layout, (N, K / 2) uint8."""
    return _aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), _INNER_K_TILES)


def unpack_int4(packed: torch.Tensor, n: int, k: int, dtype: torch.dtype = torch.uint8,
                offset: int = 0) -> torch.Tensor:
    """The inverse of `pack_int4`, transposed: (K, N) values minus `offset` in `dtype` (each k's rows are
    stored together in the packed layout)."""
    block = _block_rows()
    full, tail = divmod(n, block)
    flat = packed.reshape(-1)
    out = torch.empty(k, n, dtype=dtype)
    if full:
        _unpack_blocks(flat[: full * block * k // 2].view(full, k, block // 2), out[:, : full * block], offset)
    if tail:
        _unpack_blocks(flat[full * block * k // 2 :].view(1, k, tail // 2), out[:, full * block :], offset)
    return out


def _unpack_blocks(data: torch.Tensor, out: torch.Tensor, offset: int) -> None:
    """(blocks, K, rows / 2) packed bytes -> out (K, blocks * rows): the values minus offset, in row order."""
    blocks, k, half = data.shape
    rows = 2 * half
    lo, hi = data & 15, data >> 4
    if offset:  # 0..15 fit int8: reinterpret, then shift on the half-size nibble arrays, not on out
        lo, hi = lo.view(torch.int8) - offset, hi.view(torch.int8) - offset
    lo, hi = lo.transpose(0, 1), hi.transpose(0, 1)  # (K, blocks, rows / 2) each
    order = _row_order(rows)
    if isinstance(order, str) and order == "halves":  # byte j: rows j, j + rows / 2 (AVX-512/AVX2 full blocks)
        view = out.view(k, blocks, 2, half)
        view[:, :, 0].copy_(lo)
        view[:, :, 1].copy_(hi)
    elif isinstance(order, str):  # "pairs": byte j holds rows 2j and 2j + 1 (tail blocks, scalar builds)
        view = out.view(k, blocks, half, 2)
        view[..., 0].copy_(lo)
        view[..., 1].copy_(hi)
    else:  # an order this code does not know: gather the probed one
        nibbles = torch.stack([lo, hi], dim=3).view(k, blocks, rows)
        out.view(k, blocks, rows).copy_(nibbles[..., order])


@functools.cache
def _block_rows() -> int:
    """Rows per block of the CPU int4 layout on this machine: packs a probe whose k = 0 column is 0 and
    k = 1 column is 1; within a block every row's k = 0 nibble comes before any k = 1 nibble."""
    probe = torch.zeros(128, 2, dtype=torch.int32)
    probe[:, 1] = 1
    nibbles = _nibbles(pack_int4(probe))
    return int(nibbles.nonzero()[0])


@functools.cache
def _row_order(rows: int) -> str | torch.Tensor:
    """How one block of `rows` rows (a full block, or the tail of a matrix) orders its rows within a k:
    "halves", "pairs", or the index tensor that puts the nibbles back in row order."""
    row = torch.arange(rows, dtype=torch.int32)
    probe = torch.stack([row % 16, row // 16], dim=1)  # (rows, 2): k = 0 holds row % 16, k = 1 row // 16
    nibbles = _nibbles(pack_int4(probe))
    at = nibbles[:rows] + 16 * nibbles[rows:]  # at[p] = row whose k nibble sits at position p
    half = rows // 2
    if torch.equal(at, torch.stack([torch.arange(half), torch.arange(half, rows)], dim=1).flatten()):
        return "halves"
    if torch.equal(at, torch.arange(rows)):
        return "pairs"
    return torch.argsort(at)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    flat = packed.reshape(-1).long()
    return torch.stack([flat & 15, flat >> 4], dim=1).flatten()


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y.add_(bias)
