"""`AuthCache`: a short-lived memory of successful key lookups, so most requests skip the store.

Semantics:
    key       sha256 of the presented bearer token (the plaintext is never kept), as the store hashes it.
    epoch     the store's `auth_epoch` read BEFORE the lookup that produced an entry; the store bumps
              it after each revocation, suspension or policy change made in this process.
    put       only successful lookups (key, tenant); unknown, revoked, expired keys and suspended
              tenants always go to the store, so a new key works at once and refusals are never stale.
    get       the cached (key, tenant) while younger than `ttl_s`, taken at the current epoch, and the
              key not expired by then; else None (and the entry is dropped).
    bound     at most `max_entries`; when full, every entry older than ttl_s goes, then the oldest.

Staleness: a revocation, suspension or policy change made through this gateway (admin API, the same
Store object) applies to the next request; one made elsewhere (the CLI in another process, another
replica) within `ttl_s` (1 s by default) — the price of answering most requests without a store read.
`ttl_s = 0` turns the cache off. Not thread-safe: one event loop uses it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.store import Authenticated

DEFAULT_AUTH_CACHE_TTL_S = 1.0


@dataclass(frozen=True)
class AuthCacheConfig:
    ttl_s: float = DEFAULT_AUTH_CACHE_TTL_S  # how stale a revocation or suspension may be
    max_entries: int = 10_000

    def __post_init__(self) -> None:
        if not 0 <= self.ttl_s <= 60:
            raise ValueError(f"auth cache ttl_s must be in [0, 60] seconds, got {self.ttl_s}")
        if self.max_entries < 1:
            raise ValueError(f"auth cache max_entries must be >= 1, got {self.max_entries}")


class AuthCache:
    def __init__(self, config: AuthCacheConfig | None = None, *,
                 monotonic: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.config = config or AuthCacheConfig()
        self._monotonic = monotonic
        self._wall = wall
        self._entries: dict[str, tuple[float, int, Authenticated]] = {}  # hash -> (stored at, epoch, found)

    @property
    def enabled(self) -> bool:
        return self.config.ttl_s > 0

    def get(self, key_hash: str, epoch: int) -> Authenticated | None:
        entry = self._entries.get(key_hash)
        if entry is None:
            return None
        stored_at, stored_epoch, found = entry
        if stored_epoch != epoch or self._monotonic() - stored_at >= self.config.ttl_s \
                or not found.key.is_usable(self._wall()):
            del self._entries[key_hash]
            return None
        return found

    def put(self, key_hash: str, found: Authenticated, epoch: int) -> None:
        """Remember `found`, looked up when the store's auth_epoch was `epoch` (read before the lookup)."""
        if not self.enabled:
            return
        now = self._monotonic()
        if self._entries.pop(key_hash, None) is None and len(self._entries) >= self.config.max_entries:
            self._evict(now)
        self._entries[key_hash] = (now, epoch, found)  # at the end: entries stay in the order they were stored

    def __len__(self) -> int:
        return len(self._entries)

    def _evict(self, now: float) -> None:
        fresh = {h: e for h, e in self._entries.items() if now - e[0] < self.config.ttl_s}
        while len(fresh) >= self.config.max_entries:
            del fresh[next(iter(fresh))]  # insertion order: the oldest first
        self._entries = fresh
