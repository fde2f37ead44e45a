"""Which worker gets a request: cache- and adapter-aware, round robin, or least loaded.

Pure decisions over a snapshot of the workers in rotation (`WorkerView`); gateway/workers/router.py takes the
snapshot, applies the decision and counts it. The cache-aware strategy follows sgl-router's idea — an
approximate prefix index per worker, a match threshold, a load-imbalance fallback — with adapters added:

1. only one worker is healthy                                   → it            ("only_healthy")
2. a worker's indexed prefix covers ≥ `cache_threshold` of the prompt
                                                                → the longest match ("prefix_affinity")
3. the request's adapter is resident on some worker             → the least loaded of those ("adapter_resident")
4. the prompt has at least one full page                        → its home: the highest rendezvous hash of
                                                                  (worker, namespace + first page) ("prefix_hash")
5. otherwise (nothing cacheable)                                → the least loaded ("least_loaded")
A preference from 2, 3 or 4 is dropped for the least loaded worker ("imbalance_fallback") when its load
exceeds the least loaded worker's by more than `balance_abs_threshold` requests and by more than
`balance_rel_threshold` times. Step 4 is what lets N gateways with N separate indexes agree: a prefix
none of them has seen yet goes to the same worker from every gateway. Ties between equally loaded workers
are broken by the same rendezvous hash.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.workers.prefix_index import PrefixIndexConfig

ROUTING_STRATEGIES = ("cache_aware", "round_robin", "least_loaded")
DECISION_REASONS = ("adapter_resident", "prefix_affinity", "prefix_hash", "least_loaded", "imbalance_fallback",
                    "only_healthy", "round_robin")


@dataclass(frozen=True)
class RoutingConfig:
    strategy: str = "cache_aware"
    cache_threshold: float = 0.5  # matched prefix / prompt length needed for prefix affinity
    balance_abs_threshold: int = 4  # a preferred worker may carry this many more requests ...
    balance_rel_threshold: float = 1.5  # ... or this many times the least loaded worker's load
    prefix_index: PrefixIndexConfig = PrefixIndexConfig()

    def __post_init__(self) -> None:
        if self.strategy not in ROUTING_STRATEGIES:
            raise ValueError(f"routing strategy must be one of {', '.join(ROUTING_STRATEGIES)}, got {self.strategy!r}")
        if not 0.0 < self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in (0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")


@dataclass(frozen=True)
class WorkerView:
    """One healthy worker as the policy sees it at decision time."""

    worker_id: str
    load: int  # requests this gateway has there now + those the worker reported from other gateways
    resident_adapters: frozenset[str]  # sha256 of adapters loaded there (reported or sent by us)
    matched_tokens: int = 0  # longest indexed prefix of this prompt there


@dataclass(frozen=True)
class RouteRequest:
    prompt_len: int
    adapter_sha256: str | None
    affinity_key: bytes  # the prompt's namespace and first page: the rendezvous hash key
    has_full_page: bool = True  # False: shorter than one index page, nothing a cache could hold


@dataclass(frozen=True)
class RoutingDecision:
    worker_id: str
    reason: str  # one of DECISION_REASONS


class RoutingPolicy:
    """Stateless except for the round-robin counter."""

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self._turn = itertools.count()

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutingDecision:
        """Pick one of `workers` (non-empty, healthy). Does not modify the views."""
        if not workers:
            raise ValueError("choose() needs at least one healthy worker")
        if len(workers) == 1:
            return RoutingDecision(workers[0].worker_id, "only_healthy")
        if self.config.strategy == "round_robin":
            ordered = sorted(workers, key=lambda w: w.worker_id)
            return RoutingDecision(ordered[next(self._turn) % len(ordered)].worker_id, "round_robin")
        least = self._least_loaded(request, workers)
        if self.config.strategy == "least_loaded":
            return RoutingDecision(least.worker_id, "least_loaded")
        preferred, reason = self._preference(request, workers)
        if preferred is None:
            return RoutingDecision(least.worker_id, "least_loaded")
        if self._imbalanced(preferred.load, least.load):
            return RoutingDecision(least.worker_id, "imbalance_fallback")
        return RoutingDecision(preferred.worker_id, reason)

    def _preference(self, request: RouteRequest, workers: Sequence[WorkerView]) -> tuple[WorkerView | None, str]:
        best = max(workers, key=lambda w: (w.matched_tokens, request.adapter_sha256 in w.resident_adapters,
                                           -w.load, _tie_break(w.worker_id, request.affinity_key)))
        if request.prompt_len and best.matched_tokens / request.prompt_len >= self.config.cache_threshold:
            return best, "prefix_affinity"
        if request.adapter_sha256 is not None:
            resident = [w for w in workers if request.adapter_sha256 in w.resident_adapters]
            if resident:
                return self._least_loaded(request, resident), "adapter_resident"
        if request.has_full_page:
            return max(workers, key=lambda w: _tie_break(w.worker_id, request.affinity_key)), "prefix_hash"
        return None, "least_loaded"

    def _imbalanced(self, preferred_load: int, least_load: int) -> bool:
        excess = preferred_load - least_load
        return excess > self.config.balance_abs_threshold and preferred_load > least_load * self.config.balance_rel_threshold

    @staticmethod
    def _least_loaded(request: RouteRequest, workers: Sequence[WorkerView]) -> WorkerView:
        return min(workers, key=lambda w: (w.load, -_tie_break(w.worker_id, request.affinity_key)))


def _tie_break(worker_id: str, affinity_key: bytes) -> int:
    """Rendezvous hash: the same prompt start ranks the workers the same way in every gateway."""
    digest = hashlib.blake2b(worker_id.encode() + b"|" + affinity_key, digest_size=8)
    return int.from_bytes(digest.digest(), "big")
