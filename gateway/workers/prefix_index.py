"""An approximate, per-worker index of the prompt prefixes a gateway has sent to each engine worker.

The gateway cannot see a worker's radix cache, so it remembers what it routed: each prompt is cut into
pages of `page_size` token ids and every full page gets a chained hash — hash(namespace, hash of the
previous page, this page's ids) — so a page's hash stands for the whole prefix up to it, in one cache
namespace (tenant cache salt, adapter sha256), exactly as the engine keys its radix tree. The index maps a
page hash to the workers that were sent it and when. It is approximate on purpose: a worker may have
evicted a page the index still lists, and another gateway's requests are not listed at all.

Bounded: at most `max_pages` page hashes, least recently used dropped first; entries older than `ttl_s`
do not match. Not thread-safe: one gateway event loop owns it.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixIndexConfig:
    page_size: int = 16  # tokens per page; the workers' KV block size is the natural choice
    max_pages: int = 100_000  # page hashes kept (all workers together), LRU beyond
    ttl_s: float = 600.0  # an entry older than this no longer counts as cached

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_pages < 1:
            raise ValueError(f"max_pages must be >= 1, got {self.max_pages}")
        if self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s}")


def page_hashes(namespace: str, token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """Chained hashes of the full pages of `token_ids` in `namespace` (a trailing partial page has none)."""
    hashes: list[bytes] = []
    previous = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = token_ids[start:start + page_size]
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(b",".join(str(t).encode() for t in page))
        previous = digest.digest()
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """Page hash → {worker id: last time it was sent there}."""

    def __init__(self, config: PrefixIndexConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or PrefixIndexConfig()
        self._clock = clock
        self._pages: OrderedDict[bytes, dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pages)

    def insert(self, worker: str, namespace: str, token_ids: Sequence[int]) -> None:
        """Record that `worker` was sent this prompt. Mutates the index (and its LRU order)."""
        now = self._clock()
        for h in page_hashes(namespace, token_ids, self.config.page_size):
            workers = self._pages.get(h)
            if workers is None:
                workers = self._pages[h] = {}
            else:
                self._pages.move_to_end(h)
            workers[worker] = now
        while len(self._pages) > self.config.max_pages:
            self._pages.popitem(last=False)

    def match(self, namespace: str, token_ids: Sequence[int]) -> dict[str, int]:
        """Worker id → tokens of the longest indexed prefix of `token_ids` on it (workers with none are
        absent). Does not modify the index."""
        oldest = self._clock() - self.config.ttl_s
        matched: dict[str, int] = {}
        alive: set[str] | None = None  # workers whose match is still growing
        for depth, h in enumerate(page_hashes(namespace, token_ids, self.config.page_size), start=1):
            workers = self._pages.get(h)
            here = {w for w, seen in (workers or {}).items() if seen >= oldest}
            alive = here if alive is None else alive & here
            if not alive:
                break
            for w in alive:
                matched[w] = depth * self.config.page_size
        return matched

    def remove_worker(self, worker: str) -> None:
        """Forget everything sent to `worker` (it left the rotation; its cache is gone or unknown)."""
        for h in list(self._pages):
            workers = self._pages[h]
            workers.pop(worker, None)
            if not workers:
                del self._pages[h]
