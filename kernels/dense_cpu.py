"""Dense projection weights prepacked for oneDNN on the CPU.

torch's `F.linear` on the CPU hands an (N, K) weight to MKL/oneDNN as a transposed operand every call, and
for the few-row products of decode (M = 1 .. 32) that path streams the weight at a fraction of what the
memory allows. oneDNN's inner-product primitive over a weight reordered once, at load, into its blocked
layout (what Inductor's CPU freezing pass does, and vLLM's CPU build with its oneDNN GEMMs) runs the same
product faster at most M (a one-off timing of the bench model's 120 projections, one thread, on the
2-core AVX-512 development machine: bf16 M=1 18 ms vs 35 ms, M=32 44 vs 64; fp32 M=1 40 vs 44, M=8 39
vs 67, M=512 1.11 s vs 1.48 s; the engine-level effect is in bench/cpu_vs_llamacpp.py and
docs/benchmarks.md). bf16 results equal F.linear's bit for bit; fp32 ones differ by the summation order
(~1e-4 relative).

The packed tensor is opaque (an mkldnn tensor): `unpack` gives the (N, K) matrix back for whoever needs
the values (the dequantized state dict, tests).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

PREPACK_ENV = "LORAPLEX_CPU_PREPACK"  # "0" keeps plain F.linear (for A/B measurements)


@dataclass(frozen=True)
class PackedDense:
    """An (N, K) dense weight in oneDNN's blocked layout. CPU only."""

    packed: torch.Tensor  # opaque mkldnn tensor (torch.ops.mkldnn._reorder_linear_weight)
    shape: tuple[int, int]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * torch.empty((), dtype=self.dtype).element_size()


def can_pack(w: torch.Tensor) -> bool:
    """Whether `w` should be packed: a 2-D CPU weight in a dtype oneDNN runs natively here.

    bf16 only where oneDNN has native bf16 (avx512_bf16 / AMX); elsewhere its bf16 path is emulated.
    """
    if os.environ.get(PREPACK_ENV, "1") == "0" or w.device.type != "cpu" or w.dim() != 2:
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if w.dtype == torch.float32:
        return True
    return w.dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(w: torch.Tensor) -> PackedDense:
    """Reorder (N, K) `w` once into oneDNN's layout (no batch-size hint: one layout serves every M)."""
    w = w.contiguous()
    return PackedDense(torch.ops.mkldnn._reorder_linear_weight(w, None), (w.shape[0], w.shape[1]), w.dtype)


def linear(x: torch.Tensor, w: PackedDense, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T + bias through oneDNN's inner product over the packed weight.

    Semantics:
        y[t, n] = sum_k x[t, k] * W[n, k] + bias[n]   (the reference twin is F.linear(x, unpack(w), bias))
        x: (T, K) in w's dtype, bias: (N,) or None -> y: (T, N) in that dtype.
    """
    if x.dtype != w.dtype:
        raise ValueError(f"x is {x.dtype} but the packed weight is {w.dtype}")
    return torch.ops.mkldnn._linear_pointwise(x, w.packed, bias, "none", [], "")


def unpack(w: PackedDense) -> torch.Tensor:
    """The (N, K) matrix, as a plain tensor."""
    return w.packed.to_dense()
