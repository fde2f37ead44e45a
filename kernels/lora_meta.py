"""Per-step description of which LoRA slot each token of a batch uses, built once and shared by all layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_ADAPTER = -1


@dataclass(frozen=True)
class LoRABatchMeta:
    """Adapter slots of one step's tokens, in the forms the LoRA ops consume.

    Segments are the maximal runs of equal slot ids in token order (a prefill chunk is one run; tokens need
    not be sorted, a slot may own several segments). Slot -1 (`NO_ADAPTER`) marks base-model tokens.
    Build it with `LoRABatchMeta.build`; nothing here is mutated afterwards.
    """

    token_slots: torch.Tensor  # (T,) int32, slot per token, -1 = no adapter
    seg_starts: torch.Tensor  # (S + 1,) int32, segment s covers tokens seg_starts[s] : seg_starts[s + 1]
    seg_slots: torch.Tensor  # (S,) int32, slot of each segment (may be -1)
    active_slots: tuple[int, ...]  # distinct slots >= 0, ascending
    max_segment_len: int  # longest segment, sizes the segment kernels' grid
    # CPU grouping: (slot, rows) per active slot; rows is a slice when the slot owns one segment, else an
    # int64 index tensor. Empty when the meta lives on an accelerator (the Triton kernels do not need it).
    slot_rows: tuple[tuple[int, slice | torch.Tensor], ...]
    # CPU: the segments (start, end) of each slot of slot_rows, in the same order; empty on accelerators.
    slot_segments: tuple[tuple[tuple[int, int], ...], ...] = ()

    def __post_init__(self) -> None:
        if self.token_slots.dim() != 1:
            raise ValueError(f"token_slots must be 1-D, got shape {tuple(self.token_slots.shape)}")
        if self.seg_starts.shape[0] != self.seg_slots.shape[0] + 1:
            raise ValueError(f"seg_starts has {self.seg_starts.shape[0]} entries, expected "
                             f"len(seg_slots) + 1 = {self.seg_slots.shape[0] + 1}")
        for name in ("token_slots", "seg_starts", "seg_slots"):
            tensor = getattr(self, name)
            if tensor.dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {tensor.dtype}")
            if tensor.device != self.token_slots.device:
                raise ValueError(f"{name} is on {tensor.device}, token_slots on {self.token_slots.device}")
        if list(self.active_slots) != sorted(set(self.active_slots)) or any(s < 0 for s in self.active_slots):
            raise ValueError(f"active_slots must be distinct, ascending and >= 0, got {self.active_slots}")

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @property
    def num_segments(self) -> int:
        return self.seg_slots.shape[0]

    @property
    def device(self) -> torch.device:
        return self.token_slots.device

    @property
    def mean_segment_len(self) -> float:
        return self.num_tokens / max(1, self.num_segments)

    @classmethod
    def build(
        cls, token_slots: list[int] | torch.Tensor, device: torch.device | str | None = None
    ) -> LoRABatchMeta:
        """Describe a batch from its per-token slot ids (-1 = no adapter).

        Reads the slots on the host once (one device sync when given an accelerator tensor). The result
        lives on `device`, else on the tensor's device, else on the CPU.
        """
        if isinstance(token_slots, torch.Tensor):
            if token_slots.dim() != 1:
                raise ValueError(f"token_slots must be 1-D, got shape {tuple(token_slots.shape)}")
            if token_slots.dtype.is_floating_point or token_slots.dtype == torch.bool:
                raise ValueError(f"token_slots must hold integers, got {token_slots.dtype}")
            device = token_slots.device if device is None else device
            slots = token_slots.tolist()
        else:
            slots = [int(s) for s in token_slots]
        device = torch.device("cpu" if device is None else device)
        if any(s < NO_ADAPTER for s in slots):
            raise ValueError(f"slot ids must be >= -1 (-1 = no adapter), got {min(slots)}")

        starts: list[int] = []
        seg_slots: list[int] = []
        for t, slot in enumerate(slots):
            if t == 0 or slot != slots[t - 1]:
                starts.append(t)
                seg_slots.append(slot)
        bounds = [*starts, len(slots)]
        active = sorted({s for s in slots if s != NO_ADAPTER})
        slot_rows: list[tuple[int, slice | torch.Tensor]] = []
        slot_segments: list[tuple[tuple[int, int], ...]] = []
        if device.type == "cpu":
            owned: dict[int, list[int]] = {slot: [] for slot in active}
            for s, seg_slot in enumerate(seg_slots):
                if seg_slot != NO_ADAPTER:
                    owned[seg_slot].append(s)
            for slot in active:
                segments = tuple((bounds[s], bounds[s + 1]) for s in owned[slot])
                slot_segments.append(segments)
                if len(segments) == 1:
                    slot_rows.append((slot, slice(*segments[0])))
                else:
                    rows = [t for start, end in segments for t in range(start, end)]
                    slot_rows.append((slot, torch.tensor(rows, dtype=torch.int64)))

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(device)

        return cls(
            token_slots=as_tensor(slots),
            seg_starts=as_tensor(bounds),
            seg_slots=as_tensor(seg_slots),
            active_slots=tuple(active),
            max_segment_len=max((bounds[s + 1] - bounds[s] for s in range(len(seg_slots))), default=0),
            slot_rows=tuple(slot_rows),
            slot_segments=tuple(slot_segments),
        )
