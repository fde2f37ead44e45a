"""Multi-LoRA serving: which adapter sits in which of the `max_loras` device slots, and who holds it.

Composes the host cache (engine.lora_host_cache: registered adapters, float32 factors in host memory,
background reloads) and the device buffers (engine.lora_buffers: stacked A/B per layer and group). The
engine hands the scheduler two of its methods:

- `admission_gate(request, active_slots)`, the scheduler's last admission gate: the slot a waiting
  request runs in (-1 for the base model), or None to keep it waiting while its adapter is read from disk
  or while every slot is held (and then later requests for resident adapters wait too, so that a slot
  drains for it). Copying an adapter into a slot happens here, between steps (never inside a forward).
  Eviction takes the least recently used slot that no unfinished request holds and the user did not pin.
- `on_release(request)`: drops the request's slot pin and its hold on the host entry (finish, abort,
  error). A preempted request keeps its slot pin until it finishes, so it resumes in the same slot.

A slot holds one adapter identity (name, content digest), so new content under an old name gets a slot
of its own while requests on the old content finish in theirs. A slot whose adapter was unloaded (or
replaced) is emptied as soon as no unfinished request pins it, so `residency()` never reports content
nobody can ask for. Slot state is touched only by the engine's thread; the host cache is thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig, ModelConfig
from engine.lora_buffers import LoRADeviceBuffers, LoRAStepContext
from engine.lora_host_cache import AdapterHostCache
from engine.plan import BatchPlan
from engine.request import AdapterRef, Request
from engine.scheduler import BASE_SLOT
from wire.protocol import AdapterResidency


@dataclass
class SlotStats:
    slot_loads: int = 0  # adapters copied into a device slot
    slot_evictions: int = 0  # resident adapters replaced to make room


class LoRASlots:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.num_slots = config.max_loras
        self.max_rank = config.max_lora_rank
        self.model_config = model_config
        self.dtype = dtype
        self.device = torch.device(device)
        self.host = AdapterHostCache(model_config, config.max_lora_rank, config.resolved_max_cpu_loras())
        self.stats = SlotStats()
        self._buffers: LoRADeviceBuffers | None = None  # allocated at the first slot load
        self._owner: list[AdapterRef | None] = [None] * self.num_slots  # adapter resident in each slot
        self._rank: list[int] = [0] * self.num_slots  # rank of the adapter in each slot
        self._slot_of: dict[AdapterRef, int] = {}
        self._pins: list[int] = [0] * self.num_slots  # unfinished requests admitted into each slot
        self._last_used: list[int] = [0] * self.num_slots  # admission tick of the slot's latest use
        self._tick = 0
        self._held: dict[str, AdapterRef] = {}  # request id -> adapter it uses (host hold)
        self._admitted: dict[str, int] = {}  # request id -> slot it pins
        # Waiting requests whose adapter is in host memory but finds every slot held, by sort key. While
        # one waits, later requests stop pinning resident slots, so the slots drain (no starvation).
        self._starving: dict[str, tuple] = {}

    # ----- adapter management (engine API) ------------------------------------------------------------

    def load_adapter(self, name: str, path: str | Path, *, sha256: str | None = None) -> AdapterRef:
        """Validate and register an adapter (see AdapterHostCache.register). Raises AdapterError."""
        return self.host.register(name, path, sha256)

    def unload_adapter(self, name: str) -> AdapterRef:
        """New requests for `name` are refused; in-flight ones finish on their slot, which is emptied (and
        the host entry dropped) when the last of them ends, or now when none runs. ValueError if unknown.
        Changes slot state: call on the engine's thread."""
        ref = self.host.unregister(name)
        for slot in range(self.num_slots):
            self._empty_if_stale(slot)
        return ref

    def pin_adapter(self, name: str, pinned: bool = True) -> None:
        """A pinned adapter is never evicted from its device slot or from host memory once there.

        At least one slot stays unpinned so every other adapter can still run: ValueError otherwise.
        """
        ref = self.host.resolve(name)
        if pinned and not self.host.is_pinned(ref) and self.host.num_pinned() >= self.num_slots - 1:
            raise ValueError(
                f"cannot pin adapter {name!r}: {self.host.num_pinned()} adapters are pinned and max_loras is "
                f"{self.num_slots}; one slot must stay free for unpinned adapters"
            )
        self.host.set_pinned(name, pinned)

    def resolve(self, adapter: AdapterRef | str | None) -> AdapterRef | None:
        """The identity a new request runs with; ValueError naming an adapter that is not loaded."""
        return None if adapter is None else self.host.resolve(adapter)

    def resident_adapters(self) -> list[AdapterRef]:
        """Loaded adapters now in a device slot (for routing by residency)."""
        return [ref for ref in self._owner if ref is not None and self.host.is_registered(ref)]

    def residency(self) -> list[AdapterResidency]:
        """Every adapter held in memory, by engine name: `gpu` for those in a device slot (sorted by slot),
        then `cpu` for those only in host memory. Read on the engine's thread (slot state)."""
        # A slot left with replaced content (no pins) is free space, not a resident adapter.
        gpu = [(slot, ref) for slot, ref in enumerate(self._owner)
               if ref is not None and (self._pins[slot] > 0 or self.host.is_registered(ref))]
        out = [AdapterResidency(ref.name, "gpu", self._rank[slot], self.host.is_pinned(ref)) for slot, ref in gpu]
        in_slots = {ref for _, ref in gpu}
        out += [AdapterResidency(ref.name, "cpu", rank, pinned)
                for ref, rank, pinned in self.host.resident() if ref not in in_slots]
        return out

    # ----- request lifecycle (the scheduler's gate and release hook) ---------------------------------

    def track(self, req: Request) -> None:
        """Call once a request with an adapter is queued: holds its host entry, starts a reload if needed."""
        if req.adapter is None:
            return
        self.host.acquire(req.adapter)
        self._held[req.request_id] = req.adapter
        if req.adapter not in self._slot_of and self.host.get(req.adapter) is None:
            self.host.start_load(req.adapter)

    def admission_gate(self, req: Request, active_slots: set[int]) -> int | None:
        """The slot `req` runs in, loading its adapter into one if needed; None keeps it waiting. Pins the
        slot for `req` (until on_release), so it runs after every gate that only looks."""
        if req.adapter is None:
            return BASE_SLOT
        slot = self._admitted.get(req.request_id)  # resumed after preemption: same slot
        if slot is None:
            slot = self._slot_of.get(req.adapter)
            if slot is not None and any(key < req.sort_key for key in self._starving.values()):
                return None  # an earlier request waits for a slot: let the resident ones drain
            if slot is None:
                slot = self._load_into_slot(req.adapter)
                if slot is None:
                    if self.host.get(req.adapter) is not None:  # in memory, but every slot is held
                        self._starving[req.request_id] = req.sort_key
                    return None
            self._starving.pop(req.request_id, None)
            self._pins[slot] += 1
            self._admitted[req.request_id] = slot
        self._tick += 1
        self._last_used[slot] = self._tick
        return slot

    def on_release(self, req: Request) -> None:
        self._starving.pop(req.request_id, None)
        slot = self._admitted.pop(req.request_id, None)
        if slot is not None:
            self._pins[slot] -= 1
            self._empty_if_stale(slot)
        ref = self._held.pop(req.request_id, None)
        if ref is not None:
            self.host.release(ref)

    def close(self) -> None:
        """Stop the host cache's background reader (waits for a read in progress). Call once, at shutdown."""
        self.host.close()

    def take_load_failures(self) -> list[tuple[str, str]]:
        """(request id, reason) for waiting requests whose adapter could not be read back from disk."""
        failed = self.host.take_failures()
        if not failed:
            return []
        return [(rid, failed[ref]) for rid, ref in self._held.items()
                if ref in failed and rid not in self._admitted]

    def has_pending_loads(self) -> bool:
        return any(self.host.is_loading(ref) for rid, ref in self._held.items() if rid not in self._admitted)

    # ----- the runner's side --------------------------------------------------------------------------

    def context(self, plan: BatchPlan) -> LoRAStepContext | None:
        """This step's LoRA context (engine.models.llama.LoRAContext), None when no token uses an adapter."""
        return None if self._buffers is None else self._buffers.context_for_plan(plan)

    def context_for_tokens(self, token_slots: list[int]) -> LoRAStepContext | None:
        return None if self._buffers is None else self._buffers.context(token_slots)

    def ensure_resident(self, ref: AdapterRef) -> int:
        """Put a host-resident adapter into a slot now (engine idle: tests, tools). Returns the slot."""
        slot = self._slot_of.get(ref)
        if slot is None:
            slot = self._load_into_slot(ref)
        if slot is None:
            raise ValueError(f"adapter {ref.name!r} cannot be made resident now (not in host memory, or "
                             f"every slot is held)")
        return slot

    # ----- slots ------------------------------------------------------------------------------------

    def _load_into_slot(self, ref: AdapterRef) -> int | None:
        adapter = self.host.get(ref)
        if adapter is None:
            self.host.start_load(ref)
            return None
        slot = self._free_slot()
        if slot is None:
            return None
        if self._buffers is None:
            self._buffers = LoRADeviceBuffers(self.model_config, self.num_slots, self.max_rank, self.dtype,
                                              self.device)
        self._buffers.write(slot, adapter)
        self._owner[slot] = ref
        self._rank[slot] = adapter.rank
        self._slot_of[ref] = slot
        self.stats.slot_loads += 1
        return slot

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used evictable one (emptied), else None."""
        for slot, owner in enumerate(self._owner):
            if owner is None:
                return slot
        candidates = [s for s in range(self.num_slots) if self._pins[s] == 0 and not self._is_user_pinned(s)]
        if not candidates:
            return None
        # Content nobody can ask for any more (unloaded or replaced) goes first, then least recently used.
        victim = min(candidates, key=lambda s: (self._is_current(s), self._last_used[s]))
        owner = self._owner[victim]
        assert owner is not None
        del self._slot_of[owner]
        self._owner[victim] = None
        self.stats.slot_evictions += 1
        return victim

    def _empty_if_stale(self, slot: int) -> None:
        """Empty `slot` when it holds content nobody can ask for any more and no request pins it."""
        owner = self._owner[slot]
        if owner is not None and self._pins[slot] == 0 and not self.host.is_registered(owner):
            del self._slot_of[owner]
            self._owner[slot] = None

    def _is_user_pinned(self, slot: int) -> bool:
        owner = self._owner[slot]
        return owner is not None and self.host.is_pinned(owner)

    def _is_current(self, slot: int) -> bool:
        owner = self._owner[slot]
        return owner is not None and self.host.is_registered(owner)

    def check_integrity(self, requests: list[Request]) -> None:
        """Every slot pin and host hold belongs to an unfinished request, and the counts agree."""
        alive = {r.request_id: r for r in requests}
        for rid, slot in self._admitted.items():
            req = alive.get(rid)
            assert req is not None, f"finished request {rid} still pins LoRA slot {slot}"
            assert self._owner[slot] == req.adapter, f"request {rid} pins slot {slot} holding another adapter"
        for rid in self._held:
            assert rid in alive, f"finished request {rid} still holds adapter {self._held[rid].name}"
        for slot in range(self.num_slots):
            expected = sum(1 for s in self._admitted.values() if s == slot)
            assert self._pins[slot] == expected, f"LoRA slot {slot} has {self._pins[slot]} pins, {expected} holders"
        holds: dict[AdapterRef, int] = {}
        for ref in self._held.values():
            holds[ref] = holds.get(ref, 0) + 1
        assert self.host.users() == holds, "host cache users disagree with the requests holding adapters"
        assert {r.request_id for r in requests if r.adapter is not None} == set(self._held), \
            "a request with an adapter does not hold it"
