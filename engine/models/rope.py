"""Rotary position embeddings, HF (rotate-half) convention, with Llama 3.1 and linear scaling."""

from __future__ import annotations

import math

import torch

from engine.config import RopeConfig
from kernels.fused import rotate_half_ref


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """(head_dim / 2,) float32 inverse frequencies after scaling."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.rope_type == "linear":
        return (inv_freq / rope.factor).float()
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled).float()
    return inv_freq.float()


class RotaryEmbedding:
    """Precomputed cos/sin tables for positions 0 .. max_positions - 1."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, device: torch.device | str) -> None:
        inv_freq = inverse_frequencies(rope, head_dim).to(device)
        t = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (P, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (P, D)
        self.cos = emb.cos()
        self.sin = emb.sin()

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at `positions`, each (T, 1, D): gathered once per step, used by every layer."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (T, heads, D) -> rotated x (same dtype), computed in fp32."""
        return rotate_half_ref(x, cos, sin)
