"""The CPU path of the batched LoRA ops: the native kernel, or three torch strategies and the measured rule
that picks one per slot.

    native    every token of every slot in one call per projection group (kernels/native_cpu.py's
              `lora_add`, where it is built): each token's shrink against its slot's A at the slot's own
              ranks, then its expand over a cached transposed copy of B, in fp32, each output rounded once.
              A thread fetches the factors of the slot it takes next into L2 while it computes on the
              current one (a slot's factors are a few short runs the hardware prefetcher alone streams
              at about half the memory bandwidth). No per-slot matmul calls: the torch strategies below spend most of a multi-adapter step in
              thousands of small matmul dispatches (docs/benchmarks.md). "auto" takes it where it exists.

    by_slot   one slot at a time, straight from the padded buffers (no copy): its rows of x (a view for
              one segment), one shrink matmul over all its slices when they use the full max rank, else
              one per slice, and one in-place addmm per slice (an index_add for gathered rows). Exact
              FLOPs, a few matmuls per slot: the choice for slots that own many tokens (prefill chunks,
              a hot adapter) and for a lone small slot.
    packed    several small slots at once (punica's BGMV done densely): the slots' A rows and B columns at
              their own ranks packed into (K, H_in) and per slice (K_i, n_i), scaling folded into B; then
              x @ A_packed.T -> (T, K), a one-hot mask keeping each token's own slot's columns, and one
              addmm per slice. A constant number of ops; FLOPs times the number of slots packed.
    stacked   many small slots: slots grouped by their ranks, each group's factors stacked into
              (n, K, H_in) and (n, K_i, n_i), tokens padded per slot to the group's longest, one batched
              matmul per group and slice (SGMV without rank padding). Exact FLOPs up to the token padding,
              a few ops per rank group.

`add_lora_cpu` computes every segment of at least `by_slot_min_tokens` tokens by_slot (on views of x
and y), and so the remaining tokens of a slot when they are that many together (gathered); the other slots
go together: packed when at most `packed_max_slots`, else stacked. The constants (RULES, per dtype class)
come from bench/lora_cpu_kernels.py at the bench model's shapes (hidden 576, intermediate 1536, ranks
8/16/64 mixed, fp32 and bf16, decode batches of 1/8/32 tokens, a 512-token prefill and a mixed step, over
the distinct/uniform/skewed/identical mixes), which prints them and writes bench/results/. Mixed ranks
cost no rank padding in any strategy.

Packs and stacks are copies at the slots' real ranks, cached in `LoRAStackedWeights.cpu_cache` by slot set
(a decode batch keeps its slots for many steps) and dropped by every slot write. NOTE: the cache of one
buffer never holds more bytes than the buffer itself (oldest entries go first), so the CPU path at most
doubles the memory of the LoRA slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kernels import native_cpu
from kernels.lora_meta import LoRABatchMeta
from kernels.lora_weights import LoRAStackedWeights

Strategy = Literal["auto", "native", "by_slot", "packed", "stacked"]
STRATEGIES: tuple[Strategy, ...] = ("auto", "native", "by_slot", "packed", "stacked")


@dataclass(frozen=True)
class CpuRule:
    """The constants of the "auto" rule for one class of dtypes (see bench/lora_cpu_kernels.py)."""

    by_slot_min_tokens: int  # a segment, or a slot's remaining tokens, this long is computed by itself
    packed_max_slots: int  # the remaining slots are packed together up to this many, else stacked

    def __post_init__(self) -> None:
        if self.by_slot_min_tokens < 1 or self.packed_max_slots < 1:
            raise ValueError(f"CpuRule needs positive constants, got {self}")


# fp32 matmuls cost about 3 µs a call and 16-bit ones about 17 µs (oneDNN), so 16-bit data trades far more
# FLOPs for fewer calls. Measured with one thread on an AMD EPYC (Zen 4, avx512_bf16).
RULES: dict[str, CpuRule] = {"fp32": CpuRule(by_slot_min_tokens=8, packed_max_slots=8),
                             "16bit": CpuRule(by_slot_min_tokens=32, packed_max_slots=32)}
Rows = slice | torch.Tensor


@dataclass(frozen=True)
class PackedFactors:
    """The A rows and B columns of a set of slots at their own ranks, slice-major.

    Columns c of the shrunk activations belong to slot col_slots[c]; slice i owns columns
    slice_cols[i][0] : slice_cols[i][1]. Built from the padded buffers by `packed_factors`.
    """

    slots: tuple[int, ...]
    a: torch.Tensor  # (K, in_features): row c = lora_a[col_slots[c], i*R + j] for its slice i and rank j
    b_t: tuple[torch.Tensor | None, ...]  # per slice (K_i, n_i): scaling[s, i] * lora_b[s, off_i + n, j]
    col_slots: torch.Tensor  # (K,) int32
    slice_cols: tuple[tuple[int, int], ...]

    @property
    def width(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class StackedFactors:
    """The factors of slots with equal ranks, one slot per leading index; columns as in PackedFactors."""

    slots: tuple[int, ...]
    a: torch.Tensor  # (n, K, in_features)
    b_t: tuple[torch.Tensor | None, ...]  # per slice (n, K_i, n_i), scaling folded in
    slice_cols: tuple[tuple[int, int], ...]


def add_lora_cpu(
    y: torch.Tensor, x: torch.Tensor, weights: LoRAStackedWeights, meta: LoRABatchMeta, strategy: Strategy = "auto"
) -> None:
    """CPU `kernels.lora.add_lora`; `strategy` forces one path (tests, benchmarks), "auto" is the rule.

    Semantics:
        for every token t with s = meta.token_slots[t] >= 0 and every slice i with r = ranks[s, i] > 0:
            y[t, off_i : off_i + n_i] += scaling[s, i] * (x[t] @ A_i[s].T) @ B_i[s].T
        x: (T, H_in), y: (T, sum(n_i)) in the weights' dtype; rows with slot -1 and slices with rank 0 are
        untouched. Matmuls run in that dtype with the BLAS's own accumulation (fp32 inside for bf16/fp16);
        the shrunk activations are rounded to it once, and packs hold scaling * B rounded to it.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not meta.active_slots:
        return
    if strategy in ("auto", "native") and _add_native(y, x, weights, meta):
        return
    if strategy == "native":
        raise ValueError("the native CPU LoRA kernel is not available for these tensors")
    alone, together, how = _plan(meta, strategy, RULES["fp32" if x.dtype == torch.float32 else "16bit"])
    for slot, rows in alone:
        _add_slot(y, x, weights, slot, rows)
    if not together:
        return
    if how == "stacked":
        _add_stacked(y, x, weights, together)
        return
    slots = tuple(sorted(slot for slot, _ in together))
    if not alone:  # every token with an adapter is packed: no row gather, base rows fall to the mask
        _add_packed(y, x, weights, meta.token_slots, slots, None)
        return
    rows = torch.cat([_as_index(rows) for _, rows in together])  # (T_together,)
    _add_packed(y, x, weights, meta.token_slots.index_select(0, rows), slots, rows)


def _add_native(y: torch.Tensor, x: torch.Tensor, weights: LoRAStackedWeights, meta: LoRABatchMeta) -> bool:
    """The native kernel's add, if it runs these tensors (else False, and nothing is done)."""
    ops = native_cpu.available_for(x)
    if (ops is None or x.dtype != weights.lora_a.dtype or y.dtype != x.dtype or x.stride(1) != 1
            or y.stride(1) != 1 or not weights.lora_a.is_contiguous() or meta.token_slots.dtype != torch.int32):
        return False
    ops.lora_add(y, x, weights.lora_a, transposed_b(weights), weights.ranks, weights.scaling,
                 meta.token_slots.contiguous(), list(weights.slice_sizes))
    return True


def native_operands(weights: LoRAStackedWeights, dtype: torch.dtype) -> list[torch.Tensor] | None:
    """(lora_a, transposed B, ranks, scaling): the native kernel's operands for activations of `dtype`, as
    `_add_native` passes them (the native decode layer calls the same kernel), or None where it would not
    run them."""
    if (weights.lora_a.device.type != "cpu" or weights.lora_a.dtype != dtype or not weights.lora_a.is_contiguous()
            or native_cpu.available_for(weights.lora_a) is None):
        return None
    return [weights.lora_a, transposed_b(weights), weights.ranks, weights.scaling]


def transposed_b(weights: LoRAStackedWeights) -> torch.Tensor:
    """lora_b as (num_slots, R, sum(n_i)), contiguous: the native expand's operand, cached until a slot write."""
    key = ("b_t",)
    cached = weights.cpu_cache.get(key)
    if cached is None:
        cached = weights.lora_b.transpose(1, 2).contiguous()
        _cache_put(weights, key, cached)
    return cached


def lora_shrink_cpu(x: torch.Tensor, weights: LoRAStackedWeights, meta: LoRABatchMeta) -> torch.Tensor:
    """CPU `kernels.lora.lora_shrink`, one slot at a time in fp32.

    Semantics:
        buf[t, i*R + j] = x[t] . lora_a[s, i*R + j] for s = token_slots[t] >= 0 and j < ranks[s, i], else 0.
        x: (T, H_in) -> buf: (T, num_slices * R) float32.
    """
    buf = torch.zeros(x.shape[0], weights.lora_a.shape[1], dtype=torch.float32)  # (T, num_slices * R)
    ranks, _ = _host_ranks_and_scaling(weights)
    rank_stride = weights.max_rank
    for slot, rows in meta.slot_rows:
        x_rows = x[rows].float()  # (T_s, H_in)
        for i, rank in enumerate(ranks[slot]):
            if rank:
                a_i = weights.lora_a[slot, i * rank_stride : i * rank_stride + rank].float()  # (r, H_in)
                buf[rows, i * rank_stride : i * rank_stride + rank] = x_rows @ a_i.T
    return buf


def lora_expand_cpu(y: torch.Tensor, buf: torch.Tensor, weights: LoRAStackedWeights, meta: LoRABatchMeta) -> None:
    """CPU `kernels.lora.lora_expand`: fp32 products, each slice's sum rounded into y once.

    Semantics:
        y[t, off_i : off_i + n_i] += scaling[s, i] * buf[t, i*R : i*R + r] @ lora_b[s, off_i : off_i + n_i, :r].T
        for s = token_slots[t] >= 0 and r = ranks[s, i] > 0; other rows and slices untouched.
        buf: (T, num_slices * R) float32, y: (T, sum(n_i)).
    """
    ranks, scaling = _host_ranks_and_scaling(weights)
    rank_stride = weights.max_rank
    for slot, rows in meta.slot_rows:
        for i, (offset, size) in enumerate(zip(weights.slice_offsets, weights.slice_sizes, strict=True)):
            rank = ranks[slot][i]
            if rank:
                b_i = weights.lora_b[slot, offset : offset + size, :rank].float()  # (n_i, r)
                delta = buf[rows, i * rank_stride : i * rank_stride + rank] @ b_i.T  # (T_s, n_i) fp32
                y_rows = y[rows, offset : offset + size]
                y[rows, offset : offset + size] = (y_rows.float() + scaling[slot][i] * delta).to(y.dtype)


def packed_factors(weights: LoRAStackedWeights, slots: tuple[int, ...]) -> PackedFactors:
    """The pack of `slots` (ascending), from the cache when these slots were packed since the last write."""
    key = ("pack", slots)
    cached = weights.cpu_cache.get(key)
    if cached is not None:
        return cached
    ranks, scaling = _host_ranks_and_scaling(weights)
    rank_stride, num_slices, in_features = weights.max_rank, weights.num_slices, weights.in_features
    a_rows: list[int] = []
    col_slots: list[int] = []
    b_t: list[torch.Tensor | None] = []
    slice_cols: list[tuple[int, int]] = []
    for i, (offset, size) in enumerate(zip(weights.slice_offsets, weights.slice_sizes, strict=True)):
        start = len(a_rows)
        parts = []
        for slot in slots:
            rank = ranks[slot][i]
            if rank:
                base = (slot * num_slices + i) * rank_stride
                a_rows.extend(range(base, base + rank))
                col_slots.extend([slot] * rank)
                parts.append(weights.lora_b[slot, offset : offset + size, :rank].T * scaling[slot][i])  # (r, n_i)
        slice_cols.append((start, len(a_rows)))
        b_t.append(torch.cat(parts).contiguous() if parts else None)
    flat_a = weights.lora_a.view(-1, in_features)  # (num_slots * num_slices * R, H_in)
    pack = PackedFactors(
        slots=slots,
        a=flat_a.index_select(0, torch.tensor(a_rows, dtype=torch.int64)),
        b_t=tuple(b_t),
        col_slots=torch.tensor(col_slots, dtype=torch.int32),
        slice_cols=tuple(slice_cols),
    )
    _cache_put(weights, key, pack)
    return pack


def stacked_factors(weights: LoRAStackedWeights, slots: tuple[int, ...]) -> StackedFactors:
    """The stack of `slots` (ascending, all with the same ranks), cached like `packed_factors`."""
    key = ("stack", slots)
    cached = weights.cpu_cache.get(key)
    if cached is not None:
        return cached
    ranks, scaling = _host_ranks_and_scaling(weights)
    slot_ranks, rank_stride = ranks[slots[0]], weights.max_rank
    if any(ranks[s] != slot_ranks for s in slots):
        raise ValueError(f"slots {slots} do not share their ranks")
    index = torch.tensor(slots, dtype=torch.int64)
    a_parts: list[torch.Tensor] = []
    b_t: list[torch.Tensor | None] = []
    slice_cols: list[tuple[int, int]] = []
    start = 0
    for i, (offset, size) in enumerate(zip(weights.slice_offsets, weights.slice_sizes, strict=True)):
        rank = slot_ranks[i]
        slice_cols.append((start, start + rank))
        start += rank
        if not rank:
            b_t.append(None)
            continue
        a_parts.append(weights.lora_a[:, i * rank_stride : i * rank_stride + rank].index_select(0, index))
        scales = torch.tensor([scaling[s][i] for s in slots], dtype=weights.lora_b.dtype)
        b = weights.lora_b[:, offset : offset + size, :rank].index_select(0, index)  # (n, n_i, r)
        b_t.append((b.transpose(1, 2) * scales[:, None, None]).contiguous())  # (n, r, n_i)
    stack = StackedFactors(slots, torch.cat(a_parts, dim=1).contiguous(), tuple(b_t), tuple(slice_cols))
    _cache_put(weights, key, stack)
    return stack


def _cache_put(weights: LoRAStackedWeights, key: tuple, value: PackedFactors | StackedFactors | torch.Tensor) -> None:
    """Cache `value`, first dropping the oldest packs and stacks (dicts keep insertion order) until the
    cache, `value` included, holds no more bytes than the buffer's own lora_a and lora_b."""
    budget = weights.lora_a.nbytes + weights.lora_b.nbytes
    entries = [k for k in weights.cpu_cache if k[0] != "host"]
    held = sum(_nbytes(weights.cpu_cache[k]) for k in entries) + _nbytes(value)
    for old in entries:
        if held <= budget:
            break
        held -= _nbytes(weights.cpu_cache.pop(old))
    weights.cpu_cache[key] = value


def _nbytes(value: PackedFactors | StackedFactors | torch.Tensor) -> int:
    if isinstance(value, torch.Tensor):
        return value.nbytes
    return value.a.nbytes + sum(b.nbytes for b in value.b_t if b is not None)


def _plan(meta: LoRABatchMeta, strategy: Strategy, rule: CpuRule) -> tuple[list[tuple[int, Rows]],
                                                                         list[tuple[int, Rows]], Strategy]:
    """(work computed by_slot, slots computed together, "packed" or "stacked" for those), as (slot, rows);
    a slot may appear several times in the first list (one entry per long segment)."""
    if strategy == "by_slot":
        return list(meta.slot_rows), [], "packed"
    if strategy != "auto":
        return [], list(meta.slot_rows), strategy
    alone: list[tuple[int, Rows]] = []
    together: list[tuple[int, Rows]] = []
    threshold = rule.by_slot_min_tokens
    for (slot, rows), segments in zip(meta.slot_rows, meta.slot_segments, strict=True):
        short = [(start, end) for start, end in segments if end - start < threshold]
        if len(short) < len(segments):  # long segments: views of x and y, no gather or scatter
            alone += [(slot, slice(start, end)) for start, end in segments if end - start >= threshold]
            if not short:
                continue
            rows = torch.tensor([t for start, end in short for t in range(start, end)], dtype=torch.int64)
        num_short = sum(end - start for start, end in short)
        (alone if num_short >= threshold else together).append((slot, rows))
    if len(together) == 1:  # nothing to share: by_slot costs the same without a copy
        return alone + together, [], "packed"
    return alone, together, "packed" if len(together) <= rule.packed_max_slots else "stacked"


def _add_slot(y: torch.Tensor, x: torch.Tensor, weights: LoRAStackedWeights, slot: int, rows: Rows) -> None:
    """Rows `rows` of x and y, all of slot `slot`, through views of the padded buffers."""
    ranks, scaling = _host_ranks_and_scaling(weights)
    slot_ranks, rank_stride = ranks[slot], weights.max_rank
    x_rows = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)  # (T_s, H_in)
    shrunk: list[torch.Tensor | None]
    if min(slot_ranks) == rank_stride:  # no padding: the slot's stacked A is one contiguous matrix
        full = x_rows @ weights.lora_a[slot].T  # (T_s, num_slices * R)
        shrunk = [full[:, i * rank_stride : (i + 1) * rank_stride] for i in range(weights.num_slices)]
    else:
        shrunk = [x_rows @ weights.lora_a[slot, i * rank_stride : i * rank_stride + r].T if r else None
                  for i, r in enumerate(slot_ranks)]
    for i, (offset, size) in enumerate(zip(weights.slice_offsets, weights.slice_sizes, strict=True)):
        buf = shrunk[i]
        if buf is None:
            continue
        b_t = weights.lora_b[slot, offset : offset + size, : slot_ranks[i]].T  # (r, n_i), a view
        if isinstance(rows, slice):
            y[rows, offset : offset + size].addmm_(buf, b_t, alpha=scaling[slot][i])
        else:
            y[:, offset : offset + size].index_add_(0, rows, buf @ b_t, alpha=scaling[slot][i])


def _add_packed(
    y: torch.Tensor, x: torch.Tensor, weights: LoRAStackedWeights, token_slots: torch.Tensor,
    slots: tuple[int, ...], rows: torch.Tensor | None,
) -> None:
    """Rows `rows` of x and y (all rows when None) through the pack of `slots`; token_slots holds those
    rows' slots, for the one-hot mask (slot -1 rows match no column: they get nothing)."""
    pack = packed_factors(weights, slots)
    if pack.width == 0:
        return
    x_rows = x if rows is None else x.index_select(0, rows)  # (T', H_in)
    buf = x_rows @ pack.a.T  # (T', K)
    buf.masked_fill_(token_slots[:, None] != pack.col_slots[None, :], 0)  # keep each token's own columns
    for (offset, size), (start, end), b_t in zip(
        zip(weights.slice_offsets, weights.slice_sizes, strict=True), pack.slice_cols, pack.b_t, strict=True
    ):
        if b_t is None:
            continue
        if rows is None:
            y[:, offset : offset + size].addmm_(buf[:, start:end], b_t)
        else:
            y[:, offset : offset + size].index_add_(0, rows, buf[:, start:end] @ b_t)


def _add_stacked(
    y: torch.Tensor, x: torch.Tensor, weights: LoRAStackedWeights, slot_rows: list[tuple[int, slice | torch.Tensor]]
) -> None:
    ranks, _ = _host_ranks_and_scaling(weights)
    groups: dict[tuple[int, ...], list[tuple[int, torch.Tensor]]] = {}
    for slot, rows in slot_rows:
        if any(ranks[slot]):
            groups.setdefault(tuple(ranks[slot]), []).append((slot, _as_index(rows)))
    slices = list(zip(weights.slice_offsets, weights.slice_sizes, strict=True))
    for members in groups.values():
        stack = stacked_factors(weights, tuple(slot for slot, _ in members))
        longest = max(rows.shape[0] for _, rows in members)
        if longest == 1:
            index = torch.cat([rows for _, rows in members])  # (n,)
            pad = None
        else:  # pad each slot's rows to `longest` with row 0, masked out after the shrink
            index = torch.zeros(len(members), longest, dtype=torch.int64)
            pad = torch.ones(len(members), longest, 1, dtype=torch.bool)
            for j, (_, rows) in enumerate(members):
                index[j, : rows.shape[0]] = rows
                pad[j, : rows.shape[0]] = False
            index = index.flatten()  # (n * longest,)
        x_rows = x.index_select(0, index).view(len(members), longest, -1)  # (n, L, H_in)
        buf = torch.bmm(x_rows, stack.a.transpose(1, 2))  # (n, L, K)
        if pad is not None:
            buf.masked_fill_(pad, 0)
        for (offset, size), (start, end), b_t in zip(slices, stack.slice_cols, stack.b_t, strict=True):
            if b_t is not None:
                delta = torch.bmm(buf[:, :, start:end], b_t)  # (n, L, n_i)
                y[:, offset : offset + size].index_add_(0, index, delta.view(-1, size))


def _host_ranks_and_scaling(weights: LoRAStackedWeights) -> tuple[list[list[int]], list[list[float]]]:
    cached = weights.cpu_cache.get(("host",))
    if cached is None:
        cached = weights.cpu_cache[("host",)] = (weights.ranks.tolist(), weights.scaling.tolist())
    return cached


def _num_rows(rows: slice | torch.Tensor) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else rows.shape[0]


def _as_index(rows: slice | torch.Tensor) -> torch.Tensor:
    return torch.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows
