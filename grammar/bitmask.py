"""Token bitmasks: allocate, fill many rows in one batched call, apply to logits before sampling.

Layout: int32 tensor (batch, ceil(vocab_size / 32)) on the CPU; bit j of word w (j = 0 is the least
significant bit) allows token 32*w + j. vocab_size is the tokenizer's; the model's logits may be
wider (padded to a multiple of 64): those padded ids are always masked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from grammar.backend import GrammarMatcher


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """A (batch, ceil(vocab_size/32)) int32 CPU bitmask with every token allowed."""
    if batch < 1 or vocab_size < 1:
        raise ValueError(f"bitmask needs batch >= 1 and vocab_size >= 1, got {batch}, {vocab_size}")
    return torch.full((batch, bitmask_words(vocab_size)), -1, dtype=torch.int32)  # (batch, words)


def fill_bitmasks(matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor,
                  rows: Sequence[int] | None = None) -> None:
    """Fill bitmask[rows[i]] from matchers[i] (rows default to 0..len-1), one batched call per backend.

    Matchers must come from `CompiledGrammar.matcher()`; the matchers are not changed.
    """
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or not bitmask.is_contiguous() or bitmask.is_cuda:
        raise ValueError("bitmask must be a contiguous 2-D int32 CPU tensor (see allocate_bitmask)")
    rows = list(range(len(matchers))) if rows is None else list(rows)
    if len(rows) != len(matchers) or any(not 0 <= r < bitmask.shape[0] for r in rows):
        raise ValueError(f"{len(matchers)} matchers need as many rows within 0..{bitmask.shape[0] - 1}, got {rows}")
    groups: dict[int, tuple[Any, list[GrammarMatcher], list[int]]] = {}
    for matcher, row in zip(matchers, rows, strict=True):
        backend = matcher.backend  # type: ignore[attr-defined]
        groups.setdefault(id(backend), (backend, [], []))
        groups[id(backend)][1].append(matcher)
        groups[id(backend)][2].append(row)
    for backend, group, group_rows in groups.values():
        backend.fill_bitmasks(group, bitmask, group_rows)  # type: ignore[attr-defined]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor) -> None:
    """Mask disallowed tokens of the constrained rows of `logits` in place.

    Semantics:
        for j, r in enumerate(rows):
            for t in range(V):
                allowed = t < 32 * W and (bitmask[j, t // 32] >> (t % 32)) & 1
                if not allowed: logits[r, t] = -inf
    logits: (B, V) float on any device; bitmask: (>= len(rows), W) int32; rows: distinct ints < B.
    Sampling (greedy, temperature, top-k/top-p) runs on the masked logits afterwards.
    """
    n = len(rows)
    if n == 0:
        return
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.shape[0] < n:
        raise ValueError(f"apply_bitmask needs (B, V) logits and (>= {n}, W) int32 bitmask, got "
                         f"{tuple(logits.shape)} and {tuple(bitmask.shape)} {bitmask.dtype}")
    vocab = logits.shape[1]
    words = bitmask.shape[1]
    mask = bitmask[:n].to(logits.device, non_blocking=True)  # (n, W)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)  # (32,)
    allowed = ((mask.unsqueeze(-1) >> shifts) & 1).bool().view(n, words * 32)  # (n, 32W)
    if vocab <= words * 32:
        allowed = allowed[:, :vocab]  # (n, V)
    else:
        padding = torch.zeros(n, vocab - words * 32, dtype=torch.bool, device=logits.device)
        allowed = torch.cat([allowed, padding], dim=1)  # (n, V)
    if n == logits.shape[0] and not isinstance(rows, torch.Tensor) and list(rows) == list(range(n)):
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        index = torch.as_tensor(rows, dtype=torch.long, device=logits.device)  # (n,)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
