"""Batched multi-LoRA ops (punica-style): shrink x @ A and expand buf @ B into y, many adapters per batch.

The model calls one op per (fused) projection and layer:

    y = base_linear(x)                      # (T, out_features), e.g. fused q|k|v
    add_lora(y, x, weights, meta)           # y[t] += LoRA delta of slot meta.token_slots[t]

Dispatch: Triton kernels (kernels.lora_triton) for CUDA tensors, the CPU path (kernels.lora_cpu: by slot,
packed or stacked, chosen per batch by a measured rule) otherwise. The `*_ref` functions are the per-token torch
reference twins the tests compare both against; they gather every token's padded factors and are slow by
design, so nothing outside the tests should call them.
"""

from __future__ import annotations

from typing import Literal

import torch

from kernels.lora_cpu import add_lora_cpu, lora_expand_cpu, lora_shrink_cpu
from kernels.lora_meta import LoRABatchMeta
from kernels.lora_weights import LoRAStackedWeights

Mode = Literal["auto", "tokens", "segments"]


def add_lora(y: torch.Tensor, x: torch.Tensor, weights: LoRAStackedWeights, meta: LoRABatchMeta) -> None:
    """Add every token's LoRA delta of one projection group into y, in place.

    Semantics:
        for every token t with s = meta.token_slots[t] >= 0 and every slice i with r = ranks[s, i] > 0:
            y[t, off_i : off_i + n_i] += scaling[s, i] * (x[t] @ A_i[s].T) @ B_i[s].T
        where A_i[s] (r, H_in) and B_i[s] (n_i, r) are as in `LoRAStackedWeights`. Rows with slot -1 and
        slices with rank 0 are untouched. x: (T, H_in), y: (T, sum(n_i)); x, y and the weights share one
        dtype; accumulation is fp32 on the Triton path and the matmul's own on the CPU path (see
        `kernels.lora_cpu.add_lora_cpu`).
    """
    _check_operands(y, x, weights, meta)
    if not meta.active_slots:
        return
    if x.is_cuda:
        from kernels import lora_triton

        lora_triton.add_lora(y, x, weights, meta, _use_segments(meta, "auto"))
        return
    add_lora_cpu(y, x, weights, meta)


def lora_shrink(
    x: torch.Tensor, weights: LoRAStackedWeights, meta: LoRABatchMeta, mode: Mode = "auto"
) -> torch.Tensor:
    """Project every token onto its slot's stacked A: the first half of `add_lora`.

    Semantics:
        buf[t, i*R + j] = x[t] . lora_a[s, i*R + j]   for s = token_slots[t] >= 0 and j < ranks[s, i]
        buf[t, :] = 0 elsewhere (slot -1 rows, padded rank columns).
        x: (T, H_in) -> buf: (T, num_slices * R) float32, R = weights.max_rank.
    mode picks the Triton kernel (per-token BGMV-like or per-segment SGMV-like); "auto" takes segments
    when segments average >= 4 tokens. The CPU path ignores it and computes in fp32.
    """
    _check_operands(None, x, weights, meta)
    use_segments = _use_segments(meta, mode)
    if x.is_cuda:
        from kernels import lora_triton

        return lora_triton.shrink(x, weights, meta, use_segments)
    return lora_shrink_cpu(x, weights, meta)


def lora_expand(
    y: torch.Tensor, buf: torch.Tensor, weights: LoRAStackedWeights, meta: LoRABatchMeta, mode: Mode = "auto"
) -> None:
    """Expand the shrunk activations through each slot's B, scaled, into y's slice columns, in place.

    Semantics:
        y[t, off_i : off_i + n_i] += scaling[s, i] * buf[t, i*R : i*R + r] @ lora_b[s, off_i : off_i + n_i, :r].T
        for s = token_slots[t] >= 0 and r = ranks[s, i] > 0; other rows and slices untouched.
        buf: (T, num_slices * R) float32, y: (T, sum(n_i)). mode as in `lora_shrink`.
    """
    _check_operands(y, None, weights, meta)
    if tuple(buf.shape) != (meta.num_tokens, weights.lora_a.shape[1]):
        raise ValueError(f"buf has shape {tuple(buf.shape)}, expected {(meta.num_tokens, weights.lora_a.shape[1])}")
    use_segments = _use_segments(meta, mode)
    if y.is_cuda:
        from kernels import lora_triton

        lora_triton.expand(y, buf, weights, meta, use_segments)
        return
    lora_expand_cpu(y, buf, weights, meta)


def lora_shrink_ref(x: torch.Tensor, weights: LoRAStackedWeights, token_slots: torch.Tensor) -> torch.Tensor:
    """Per-token torch reference of `lora_shrink` (same Semantics), gathering each token's A; fp32."""
    valid = token_slots >= 0  # (T,)
    slots = token_slots.clamp(min=0).long()
    a = weights.lora_a[slots].float()  # (T, num_slices * R, H_in)
    buf = torch.einsum("th,tkh->tk", x.float(), a)
    return buf * _rank_mask(weights, slots, valid).flatten(1)


def lora_expand_ref(
    y: torch.Tensor, buf: torch.Tensor, weights: LoRAStackedWeights, token_slots: torch.Tensor
) -> None:
    """Per-token torch reference of `lora_expand` (same Semantics), gathering each token's B; fp32."""
    valid = token_slots >= 0  # (T,)
    slots = token_slots.clamp(min=0).long()
    rank = weights.max_rank
    masked = buf.float().view(-1, weights.num_slices, rank) * _rank_mask(weights, slots, valid)
    for i, (offset, size) in enumerate(zip(weights.slice_offsets, weights.slice_sizes, strict=True)):
        b = weights.lora_b[slots, offset : offset + size].float()  # (T, n_i, R)
        delta = torch.einsum("tr,tnr->tn", masked[:, i], b) * weights.scaling[slots, i][:, None]
        updated = y[:, offset : offset + size].float() + delta
        y[valid, offset : offset + size] = updated[valid].to(y.dtype)


def add_lora_ref(y: torch.Tensor, x: torch.Tensor, weights: LoRAStackedWeights, token_slots: torch.Tensor) -> None:
    """Per-token torch reference of `add_lora`: expand_ref(shrink_ref(x))."""
    lora_expand_ref(y, lora_shrink_ref(x, weights, token_slots), weights, token_slots)


def _rank_mask(weights: LoRAStackedWeights, slots: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(T, num_slices, R) float mask: 1 where j < ranks[slot[t], i] and the token has an adapter."""
    ranks = weights.ranks[slots]  # (T, num_slices)
    j = torch.arange(weights.max_rank, device=slots.device)
    return ((j[None, None, :] < ranks[:, :, None]) & valid[:, None, None]).float()


def _use_segments(meta: LoRABatchMeta, mode: Mode) -> bool:
    if mode not in ("auto", "tokens", "segments"):
        raise ValueError(f"mode must be 'auto', 'tokens' or 'segments', got {mode!r}")
    # NOTE: the threshold is a guess; tokens vs segments (and padding vs rank groups) must be timed on a GPU.
    return mode == "segments" or (mode == "auto" and meta.mean_segment_len >= 4.0)


def _check_operands(
    y: torch.Tensor | None, x: torch.Tensor | None, weights: LoRAStackedWeights, meta: LoRABatchMeta
) -> None:
    if x is not None:
        if tuple(x.shape) != (meta.num_tokens, weights.in_features):
            raise ValueError(f"x has shape {tuple(x.shape)}, expected {(meta.num_tokens, weights.in_features)}")
        if x.dtype != weights.lora_a.dtype:
            raise ValueError(f"x is {x.dtype} but the LoRA weights are {weights.lora_a.dtype}")
    if y is not None:
        if tuple(y.shape) != (meta.num_tokens, weights.out_features):
            raise ValueError(f"y has shape {tuple(y.shape)}, expected {(meta.num_tokens, weights.out_features)}")
        if y.dtype != weights.lora_b.dtype:
            raise ValueError(f"y is {y.dtype} but the LoRA weights are {weights.lora_b.dtype}")
    for tensor in (x, y, weights.lora_a):
        if tensor is not None and tensor.device != meta.device:
            raise ValueError(f"tensor on {tensor.device} but the batch meta is on {meta.device}")
    if meta.active_slots and meta.active_slots[-1] >= weights.num_slots:
        raise ValueError(f"slot {meta.active_slots[-1]} is outside the {weights.num_slots} slots")
