"""Registered LoRA adapters and the host-memory cache of their factors (S-LoRA's host tier).

Three tiers: an adapter is *registered* (name -> current content identity and the directory it came from),
its float32 factors may be *host resident* (at most `capacity` entries, LRU), and the slot manager
(engine.lora_slots) copies host-resident adapters into *device slots*. Host entries that an unfinished
request uses or that the user pinned are never evicted; the cache may exceed `capacity` only while every
entry is protected. An adapter evicted from host memory is read again from its directory in a background
thread when a request needs it (LoRAX-style just in time), so the step loop never waits on a disk read.

Thread safety: every method may be called from any thread; one lock guards all state. Reading and
validating files happens outside the lock.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from adapters.errors import AdapterError
from adapters.lora_adapter import LoRAAdapter, load_peft_adapter
from engine.config import ModelConfig
from engine.request import AdapterRef

log = logging.getLogger(__name__)


@dataclass
class HostCacheStats:
    host_loads: int = 0  # adapter directories read into host memory (first loads and reloads)
    host_evictions: int = 0  # host entries dropped to stay within capacity


@dataclass
class _Registration:
    ref: AdapterRef  # the content new requests get
    path: Path
    pinned: bool = False


class AdapterHostCache:
    def __init__(self, model_config: ModelConfig, max_lora_rank: int, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"max_cpu_loras must be positive, got {capacity}")
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.capacity = capacity
        self.stats = HostCacheStats()
        self._lock = threading.Lock()
        self._registered: dict[str, _Registration] = {}  # name -> current content
        self._paths: dict[AdapterRef, Path] = {}  # every identity still registered or in use -> its files
        self._loaded: OrderedDict[AdapterRef, LoRAAdapter] = OrderedDict()  # least recently used first
        self._users: Counter[AdapterRef] = Counter()  # unfinished requests per identity
        self._loading: set[AdapterRef] = set()
        self._failed: dict[AdapterRef, str] = {}  # background reloads that failed, with the reason
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-host-load")

    # ----- registry ----------------------------------------------------------------------------------

    def register(self, name: str, path: str | Path, sha256: str | None = None) -> AdapterRef:
        """Read, validate and cache an adapter under `name`; returns its identity.

        Idempotent for the same name and content. New content under a known name replaces it for new
        requests; requests already using the old content keep it until they finish. Raises AdapterError
        (one line naming the problem) and changes nothing when the adapter cannot be served.
        """
        adapter = self._read(name, Path(path))
        if sha256 is not None and adapter.sha256 != sha256:
            raise AdapterError(
                f"adapter {name!r}: content digest is {adapter.sha256}, but {sha256} was expected"
            )
        ref = AdapterRef(name, adapter.sha256)
        with self._lock:
            if ref not in self._loaded:
                self.stats.host_loads += 1
            old = self._registered.get(name)
            pinned = old.pinned if old is not None else False
            self._registered[name] = _Registration(ref, Path(path), pinned)
            self._paths[ref] = Path(path)
            self._loaded[ref] = adapter
            self._loaded.move_to_end(ref)
            if old is not None and old.ref != ref:
                self._forget_if_unused(old.ref)
            self._evict_over_capacity()
        return ref

    def unregister(self, name: str) -> AdapterRef:
        """Refuse new requests for `name`; in-flight requests keep its content until they finish."""
        with self._lock:
            reg = self._registered.pop(name, None)
            if reg is None:
                raise ValueError(f"adapter {name!r} is not loaded")
            self._forget_if_unused(reg.ref)
            return reg.ref

    def set_pinned(self, name: str, pinned: bool) -> None:
        with self._lock:
            reg = self._registered.get(name)
            if reg is None:
                raise ValueError(f"adapter {name!r} is not loaded")
            reg.pinned = pinned

    def resolve(self, adapter: AdapterRef | str) -> AdapterRef:
        """The identity a new request runs with. Raises ValueError naming an unknown or stale adapter."""
        name = adapter.name if isinstance(adapter, AdapterRef) else adapter
        if not isinstance(name, str):
            raise ValueError(f"adapter must be a name or an AdapterRef, got {type(adapter).__name__}")
        with self._lock:
            reg = self._registered.get(name)
        if reg is None:
            raise ValueError(f"adapter {name!r} is not loaded")
        if isinstance(adapter, AdapterRef) and adapter != reg.ref:
            raise ValueError(
                f"adapter {name!r} version {adapter.sha256[:12]} is no longer loaded "
                f"(the current version is {reg.ref.sha256[:12]})"
            )
        return reg.ref

    def is_pinned(self, ref: AdapterRef) -> bool:
        with self._lock:
            reg = self._registered.get(ref.name)
            return reg is not None and reg.pinned and reg.ref == ref

    def is_registered(self, ref: AdapterRef) -> bool:
        with self._lock:
            reg = self._registered.get(ref.name)
            return reg is not None and reg.ref == ref

    def registered(self) -> dict[str, AdapterRef]:
        with self._lock:
            return {name: reg.ref for name, reg in self._registered.items()}

    def num_pinned(self) -> int:
        with self._lock:
            return sum(reg.pinned for reg in self._registered.values())

    # ----- use by requests ---------------------------------------------------------------------------

    def acquire(self, ref: AdapterRef) -> None:
        """A request now uses `ref`: its host entry (and its files' path) stay until `release`."""
        with self._lock:
            if ref not in self._paths:
                raise ValueError(f"adapter {ref.name!r} is not loaded")
            self._users[ref] += 1

    def release(self, ref: AdapterRef) -> None:
        with self._lock:
            self._users[ref] -= 1
            if self._users[ref] <= 0:
                del self._users[ref]
                self._forget_if_unused(ref)
                self._evict_over_capacity()

    def get(self, ref: AdapterRef) -> LoRAAdapter | None:
        """The host-resident factors of `ref` (marking them recently used), or None."""
        with self._lock:
            adapter = self._loaded.get(ref)
            if adapter is not None:
                self._loaded.move_to_end(ref)
            return adapter

    def start_load(self, ref: AdapterRef) -> None:
        """Read `ref` into host memory in the background unless it is resident, loading, or failed."""
        with self._lock:
            if ref in self._loaded or ref in self._loading or ref in self._failed:
                return
            path = self._paths.get(ref)
            if path is None:
                return
            self._loading.add(ref)
        self._executor.submit(self._load_in_background, ref, path)

    def is_loading(self, ref: AdapterRef) -> bool:
        with self._lock:
            return ref in self._loading

    def take_failures(self) -> dict[AdapterRef, str]:
        """Background loads that failed since the last call, with one-line reasons. Clears them."""
        with self._lock:
            failed, self._failed = self._failed, {}
            return failed

    def users(self) -> dict[AdapterRef, int]:
        with self._lock:
            return dict(self._users)

    def num_resident(self) -> int:
        with self._lock:
            return len(self._loaded)

    def resident(self) -> list[tuple[AdapterRef, int, bool]]:
        """(identity, rank, pinned) of every adapter whose factors are in host memory now, least recently
        used first. This operation does not change the cache (nor the LRU order)."""
        with self._lock:
            out = []
            for ref, adapter in self._loaded.items():
                reg = self._registered.get(ref.name)
                out.append((ref, adapter.rank, reg is not None and reg.pinned and reg.ref == ref))
            return out

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    # ----- internals --------------------------------------------------------------------------------

    def _read(self, name: str, path: Path) -> LoRAAdapter:
        return load_peft_adapter(path, self.model_config, name=name, max_lora_rank=self.max_lora_rank)

    def _load_in_background(self, ref: AdapterRef, path: Path) -> None:
        error = None
        adapter = None
        try:
            adapter = self._read(ref.name, path)
            if adapter.sha256 != ref.sha256:
                error = (f"adapter {ref.name!r}: the files at {path} changed since it was loaded "
                         f"(digest {adapter.sha256[:12]}, expected {ref.sha256[:12]})")
        except (AdapterError, OSError) as e:
            error = f"adapter {ref.name!r} could not be reloaded: {e}"
        except Exception as e:  # noqa: BLE001 -- a background thread must report, never raise
            log.exception("reloading adapter %s failed", ref.name)
            error = f"adapter {ref.name!r} could not be reloaded: {type(e).__name__}: {e}"
        with self._lock:
            self._loading.discard(ref)
            if error is not None or adapter is None:
                self._failed[ref] = error or "unknown error"
                return
            if ref in self._paths:
                self.stats.host_loads += 1
                self._loaded[ref] = adapter
                self._evict_over_capacity()

    def _forget_if_unused(self, ref: AdapterRef) -> None:
        """Drop an identity nobody can ask for any more (not current, no users). Lock held."""
        reg = self._registered.get(ref.name)
        if self._users.get(ref, 0) == 0 and (reg is None or reg.ref != ref):
            self._paths.pop(ref, None)
            self._loaded.pop(ref, None)

    def _evict_over_capacity(self) -> None:
        """Evict least recently used entries that no request uses and nobody pinned. Lock held."""
        if len(self._loaded) <= self.capacity:
            return
        for ref in list(self._loaded):
            if len(self._loaded) <= self.capacity:
                break
            reg = self._registered.get(ref.name)
            pinned = reg is not None and reg.pinned and reg.ref == ref
            if self._users.get(ref, 0) == 0 and not pinned:
                del self._loaded[ref]
                self.stats.host_evictions += 1
