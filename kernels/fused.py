"""Fused elementwise steps of a decoder layer: the native CPU op where it is built, the torch twin elsewhere.

    add_rms_norm    the residual add after a sublayer and the next sublayer's RMSNorm
    silu_mul        the MLP's SiLU-and-multiply of the fused gate/up projection
    rope_store_kv   RoPE on q and k, and k and v written to their paged-cache slots

At batch 1 each of these is several torch dispatches of a few microseconds over a few kilobytes; fused
they are one (kernels/native_cpu.py). Both forms compute the same thing in the same dtypes; the native
one sums the RMS in another order (a one-off check on (32, 576): fp32 at most 3.4e-7 relative, bf16 equal).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import native_cpu
from kernels.attention import NATIVE_CACHE_DTYPES, write_kv


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Semantics: weight * (x.float() * rsqrt(mean(x.float()^2, -1) + eps)).to(x.dtype) (HF's LlamaRMSNorm)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + delta, rms_norm of it): the residual stream after a sublayer and the next sublayer's input.

    Semantics:
        new = residual + delta (in residual's dtype; residual itself when delta is None)
        return new, rms_norm_ref(new, weight, eps)
    residual, delta: (T, H); weight: (H,). The native op updates `residual` in place and returns it as `new`:
    callers pass a residual they own (the layer loop's running hidden state).
    """
    ops = native_cpu.available_for(residual)
    if (ops is not None and residual.dim() == 2 and residual.stride(1) == 1 and weight.dtype == residual.dtype
            and (delta is None or (delta.dtype == residual.dtype and delta.stride(1) == 1))):
        return residual, ops.add_rms_norm(residual, delta, weight.contiguous(), eps)
    new = residual if delta is None else residual + delta
    return new, rms_norm_ref(new, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Semantics: F.silu(gate) * up for gate, up = gate_up.chunk(2, -1); gate_up (T, 2I) -> (T, I)."""
    ops = native_cpu.available_for(gate_up)
    if ops is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1:
        return ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_half_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Semantics (HF's rotate-half RoPE, in fp32, rounded to x's dtype):
        out = x * cos + cat(-x[..., D/2:], x[..., :D/2]) * sin
    x: (T, heads, D); cos, sin: (T, 1, D) float32."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def rope_store_kv(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """The rotated queries (T, H_q, D); the rotated keys and `v` are written to their cache slots.

    Semantics:
        rot = rotate_half_ref(qk, cos, sin)          qk: (T, H_q + H_kv, D), queries then keys
        write_kv(rot[:, H_q:], v, k_cache, v_cache, slot_mapping)
        return rot[:, :H_q]
    The native op rotates `qk` in place (it is a view into the step's fused projection, owned by the
    caller) and returns a view of it.
    """
    ops = native_cpu.available_for(qk)
    if (ops is not None and qk.stride(-1) == 1 and v.stride(-1) == 1 and v.dtype == qk.dtype
            and k_cache.dtype in NATIVE_CACHE_DTYPES[qk.dtype] and k_cache.stride() == v_cache.stride()
            and k_cache.stride(-1) == 1):
        n_tok, _, head_dim = qk.shape
        ops.rope_store_kv(qk, v, cos.reshape(n_tok, head_dim), sin.reshape(n_tok, head_dim), num_q_heads,
                          k_cache, v_cache, slot_mapping)
        return qk[:, :num_q_heads]
    rot = rotate_half_ref(qk, cos, sin)
    write_kv(rot[:, num_q_heads:], v, k_cache, v_cache, slot_mapping)
    return rot[:, :num_q_heads]
