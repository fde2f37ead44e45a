"""Stacked LoRA slot buffers for one (possibly fused) projection of one layer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class LoRAStackedWeights:
    """Every slot's LoRA A/B for one projection group, zero-padded to one max rank.

    A fused group (q/k/v, or gate/up) has several output slices sharing one input: A stacks the slices
    along the rank axis, B stacks them along the output axis, so slice i of slot s is
        A_i = lora_a[s, i*R : i*R + ranks[s, i], :]          (r_i, in_features)
        B_i = lora_b[s, off_i : off_i + n_i, : ranks[s, i]]   (n_i, r_i)
    with R = max_rank, n_i = slice_sizes[i], off_i = sum(slice_sizes[:i]). A slice with rank 0 is not
    adapted by that slot. The kernels never read past a slot's rank, so padding content is irrelevant.
    The tensors are written in place by `write_slot` / `clear_slot`; the fields themselves never change.
    NOTE: write slots only through `write_slot` / `clear_slot`: they also drop `cpu_cache`, the CPU path's
    host copy of ranks and scaling and its packed factors (kernels.lora_cpu), which would otherwise go stale.
    """

    lora_a: torch.Tensor  # (num_slots, num_slices * max_rank, in_features)
    lora_b: torch.Tensor  # (num_slots, sum(slice_sizes), max_rank)
    scaling: torch.Tensor  # (num_slots, num_slices) float32, alpha / r per slot and slice
    ranks: torch.Tensor  # (num_slots, num_slices) int32, 0 = slice not adapted
    slice_sizes: tuple[int, ...]  # output width of each slice, e.g. (q, k, v) or (gate, up)
    # Derived data of the CPU path keyed by what it was built from; owned by kernels.lora_cpu, emptied on
    # every slot write. Not an init argument, so dataclasses.replace() starts an empty one.
    cpu_cache: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.lora_a.dim() != 3 or self.lora_b.dim() != 3:
            raise ValueError(f"lora_a and lora_b must be 3-D, got {tuple(self.lora_a.shape)} and "
                             f"{tuple(self.lora_b.shape)}")
        num_slots, stacked_rank, _ = self.lora_a.shape
        num_slices = len(self.slice_sizes)
        if num_slices == 0 or any(n <= 0 for n in self.slice_sizes):
            raise ValueError(f"slice_sizes must be positive and non-empty, got {self.slice_sizes}")
        if stacked_rank % num_slices:
            raise ValueError(f"lora_a rank axis {stacked_rank} is not a multiple of {num_slices} slices")
        expected_b = (num_slots, sum(self.slice_sizes), stacked_rank // num_slices)
        if tuple(self.lora_b.shape) != expected_b:
            raise ValueError(f"lora_b has shape {tuple(self.lora_b.shape)}, expected {expected_b}")
        for name, dtype in (("scaling", torch.float32), ("ranks", torch.int32)):
            tensor = getattr(self, name)
            if tuple(tensor.shape) != (num_slots, num_slices) or tensor.dtype != dtype:
                raise ValueError(f"{name} must be {dtype} of shape {(num_slots, num_slices)}, got "
                                 f"{tensor.dtype} {tuple(tensor.shape)}")
        if self.lora_a.dtype != self.lora_b.dtype:
            raise ValueError(f"lora_a is {self.lora_a.dtype} but lora_b is {self.lora_b.dtype}")
        devices = {t.device for t in (self.lora_a, self.lora_b, self.scaling, self.ranks)}
        if len(devices) != 1:
            raise ValueError(f"LoRA buffers are spread over devices {sorted(map(str, devices))}")

    @classmethod
    def allocate(
        cls,
        num_slots: int,
        max_rank: int,
        in_features: int,
        slice_sizes: Sequence[int],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> LoRAStackedWeights:
        """Empty slots (every rank 0) for a group with `len(slice_sizes)` output slices."""
        if num_slots <= 0 or max_rank <= 0 or in_features <= 0:
            raise ValueError(f"num_slots, max_rank and in_features must be positive, got "
                             f"{num_slots}, {max_rank}, {in_features}")
        sizes = tuple(int(n) for n in slice_sizes)
        return cls(
            lora_a=torch.zeros(num_slots, len(sizes) * max_rank, in_features, dtype=dtype, device=device),
            lora_b=torch.zeros(num_slots, sum(sizes), max_rank, dtype=dtype, device=device),
            scaling=torch.zeros(num_slots, len(sizes), dtype=torch.float32, device=device),
            ranks=torch.zeros(num_slots, len(sizes), dtype=torch.int32, device=device),
            slice_sizes=sizes,
        )

    @property
    def num_slots(self) -> int:
        return self.lora_a.shape[0]

    @property
    def num_slices(self) -> int:
        return len(self.slice_sizes)

    @property
    def max_rank(self) -> int:
        return self.lora_b.shape[2]

    @property
    def in_features(self) -> int:
        return self.lora_a.shape[2]

    @property
    def out_features(self) -> int:
        return self.lora_b.shape[1]

    @property
    def slice_offsets(self) -> tuple[int, ...]:
        offsets = [0]
        for n in self.slice_sizes[:-1]:
            offsets.append(offsets[-1] + n)
        return tuple(offsets)

    def write_slot(
        self,
        slot: int,
        a: Sequence[torch.Tensor | None],
        b: Sequence[torch.Tensor | None],
        scaling: Sequence[float] | float,
    ) -> None:
        """Load one adapter into `slot`: per slice an A (r, in_features) and B (n_i, r), or None.

        Mutates this slot's rows of every buffer (padding is zeroed); other slots are untouched.
        """
        self._check_slot(slot)
        self.cpu_cache.clear()
        if len(a) != self.num_slices or len(b) != self.num_slices:
            raise ValueError(f"expected {self.num_slices} A and B matrices, got {len(a)} and {len(b)}")
        scales = [float(scaling)] * self.num_slices if isinstance(scaling, int | float) else list(scaling)
        if len(scales) != self.num_slices:
            raise ValueError(f"expected {self.num_slices} scaling values, got {len(scales)}")
        self.clear_slot(slot)
        for i, (a_i, b_i, offset, size) in enumerate(zip(a, b, self.slice_offsets, self.slice_sizes, strict=True)):
            if (a_i is None) != (b_i is None):
                raise ValueError(f"slice {i}: A and B must both be given or both be None")
            if a_i is None or b_i is None:
                continue
            rank = a_i.shape[0]
            if not 0 < rank <= self.max_rank:
                raise ValueError(f"slice {i}: rank {rank} is outside 1..{self.max_rank}")
            if tuple(a_i.shape) != (rank, self.in_features) or tuple(b_i.shape) != (size, rank):
                raise ValueError(f"slice {i}: A {tuple(a_i.shape)} / B {tuple(b_i.shape)} do not fit "
                                 f"({rank}, {self.in_features}) / ({size}, {rank})")
            base = i * self.max_rank
            self.lora_a[slot, base : base + rank].copy_(a_i)
            self.lora_b[slot, offset : offset + size, :rank].copy_(b_i)
            self.ranks[slot, i] = rank
            self.scaling[slot, i] = scales[i]

    def clear_slot(self, slot: int) -> None:
        """Zero one slot (rank 0 everywhere): tokens routed to it get no LoRA delta."""
        self._check_slot(slot)
        self.cpu_cache.clear()
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.scaling[slot].zero_()
        self.ranks[slot].zero_()

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is outside 0..{self.num_slots - 1}")
