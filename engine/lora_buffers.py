"""Device-side LoRA slots: stacked A/B buffers for every layer and fused projection group.

The model adds LoRA deltas into its fused projections (engine.models.llama): "qkv" (q|k|v slices),
"o", "gate_up" (gate|up slices) and "down". Each (layer, group) gets one `LoRAStackedWeights` with
`max_loras` slots padded to `max_lora_rank`; writing an adapter into a slot copies its factors there.
A step's `LoRAStepContext` carries the per-token slot ids and calls the batched kernel per group.
"""

from __future__ import annotations

import torch

from adapters.errors import AdapterError
from adapters.lora_adapter import LoRAAdapter
from engine.config import ModelConfig
from engine.plan import BatchPlan
from kernels.lora import add_lora
from kernels.lora_cpu import native_operands
from kernels.lora_meta import NO_ADAPTER, LoRABatchMeta
from kernels.lora_weights import LoRAStackedWeights

# Fused projection group -> the HF projections it stacks, in the model's slice order.
GROUP_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class LoRAStepContext:
    """One step's LoRA work: which slot each token uses. Implements engine.models.llama.LoRAContext."""

    def __init__(self, buffers: LoRADeviceBuffers, meta: LoRABatchMeta) -> None:
        self._buffers = buffers
        self.meta = meta  # NOTE: how to batch the slots' work (CPU strategies, Triton) is kernels.lora's choice

    def add(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each token's adapter delta for `group` of `layer`, in place (see kernels.lora.add_lora)."""
        if not self._buffers.is_adapted(layer, group, self.meta.active_slots):
            return
        add_lora(y, x, self._buffers.weights[layer][group], self.meta)


    def native_layer_args(self, layer: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[int]] | None:
        """`layer`'s LoRA operands for the native layer (kernels/csrc/cpu_ops.cpp, layer_forward): per
        group the slice count (0 where no active slot adapts it) then its slice widths, and the four
        operands of each adapted group (kernels.lora_cpu.native_operands). None where the native kernel
        would not run a group: the layer then runs op by op."""
        if self.meta.token_slots.dtype != torch.int32:
            return None
        # the same for every step with these active slots until a slot write: built once (30 layers' worth
        # of checks and lists took 1.7 ms of a decode step with 8 adapters under cProfile)
        key = (layer, dtype, self.meta.active_slots)
        cache = self._buffers.native_args_cache
        if key in cache:
            return cache[key]
        if len(cache) >= 4096:  # many slot sets seen since the last write: start over, not grow without bound
            cache.clear()
        cache[key] = args = self._native_layer_args(layer, dtype)
        return args

    def _native_layer_args(self, layer: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[int]] | None:
        tensors: list[torch.Tensor] = []
        groups: list[int] = []
        for group in GROUP_PROJECTIONS:
            if not self._buffers.is_adapted(layer, group, self.meta.active_slots):
                groups.append(0)
                continue
            weights = self._buffers.weights[layer][group]
            operands = native_operands(weights, dtype)
            if operands is None:
                return None
            tensors += operands
            groups += [len(weights.slice_sizes), *weights.slice_sizes]
        return tensors, groups


class LoRADeviceBuffers:
    """`num_slots` adapter slots for every (layer, group), on the runner's device and in its dtype.

    Mutated only by `write` (between steps, never during a forward).
    """

    def __init__(self, model_config: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        mc = model_config
        shapes = mc.lora_module_shapes()  # projection -> (in_features, out_features)
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = torch.device(device)
        self.weights: list[dict[str, LoRAStackedWeights]] = [
            {
                group: LoRAStackedWeights.allocate(
                    num_slots, max_rank, shapes[projs[0]][0], [shapes[p][1] for p in projs], dtype, device
                )
                for group, projs in GROUP_PROJECTIONS.items()
            }
            for _ in range(mc.num_layers)
        ]
        # Host mirror of which (layer, group) each slot adapts, so unadapted groups skip the kernel call.
        self._adapted: list[list[set[str]]] = [[set() for _ in range(mc.num_layers)] for _ in range(num_slots)]
        # LoRAStepContext.native_layer_args by (layer, dtype, active slots); emptied by every write (callers
        # never mutate what it holds). An entry keeps its transposed B alive should the CPU path's own cache
        # drop it (kernels.lora_cpu._cache_put): the same values, as B changes only in a write.
        self.native_args_cache: dict[tuple[int, torch.dtype, tuple[int, ...]],
                                     tuple[list[torch.Tensor], list[int]] | None] = {}

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy every factor of `adapter` into `slot` (the slot's previous content is replaced).

        Raises AdapterError, with the slot untouched, for a factor or scaling that is not finite in the
        buffers' dtype (checked before anything is copied, so the step that would run it never does)."""
        self.check_fits(adapter)
        self.native_args_cache.clear()
        for layer, groups in enumerate(self.weights):
            adapted = self._adapted[slot][layer]
            adapted.clear()
            for group, projs in GROUP_PROJECTIONS.items():
                modules = [adapter.module(layer, p) for p in projs]
                stacked = groups[group]
                if all(m is None for m in modules):
                    stacked.clear_slot(slot)
                    continue
                stacked.write_slot(
                    slot,
                    [None if m is None else m.lora_a for m in modules],
                    [None if m is None else m.lora_b for m in modules],
                    [0.0 if m is None else m.scaling for m in modules],
                )
                adapted.add(group)

    def check_fits(self, adapter: LoRAAdapter) -> None:
        """AdapterError naming the first factor or scaling of `adapter` that overflows this buffer's
        dtype (scalings live in float32). This operation does not modify the buffers."""
        dtype = self.weights[0]["qkv"].lora_a.dtype
        limit = min(torch.finfo(dtype).max, torch.finfo(torch.float32).max)
        for (layer, proj), m in adapter.weights.items():
            if not abs(m.scaling) <= limit:
                raise AdapterError(f"adapter {adapter.name!r}: the scaling of layer {layer} {proj} "
                                   f"({m.scaling:.3g}) is not finite in {dtype}")
            for factor, tensor in (("lora_A", m.lora_a), ("lora_B", m.lora_b)):
                if tensor.numel() and not bool(tensor.abs().max() <= limit):  # NaN compares False
                    raise AdapterError(f"adapter {adapter.name!r}: layer {layer} {proj} {factor} holds values "
                                       f"that are not finite in {dtype}")

    def is_adapted(self, layer: int, group: str, slots: tuple[int, ...]) -> bool:
        return any(group in self._adapted[s][layer] for s in slots)

    def context(self, token_slots: list[int]) -> LoRAStepContext | None:
        """A step context for these per-token slots (-1 = base), or None when no token uses an adapter."""
        if all(s == NO_ADAPTER for s in token_slots):
            return None
        return LoRAStepContext(self, LoRABatchMeta.build(token_slots, self.device))

    def context_for_plan(self, plan: BatchPlan) -> LoRAStepContext | None:
        token_slots: list[int] = []
        for seq in plan.seqs:
            token_slots.extend([seq.lora_slot] * seq.query_len)
        return self.context(token_slots)
