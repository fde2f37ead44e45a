"""`QuotaSettings`, `build_quota_backend` and `build_admission`: how `loraplex serve` (and every gateway
test) assembles the admission: GatedAdmission([QuotaGate(quota backend), FairQueueGate(fair queue)]).

Backends:
    no Redis URL   MemoryQuotaBackend (one gateway). Budget counters persist in
                   <data-dir>/quota_ledger.db (policies.SqliteUsageLedger): reservations are booked at
                   admission and corrected at reconcile, so the ledger needs signed updates per UTC day /
                   month, which the store's hourly usage counters (record_usage, non-negative) do not take.
                   The store keeps recording final usage for reports; the ledger is only for budgets.
    Redis URL      RedisQuotaBackend (exact across replicas; budgets in Redis) wrapped in
                   FailoverQuotaBackend with the configured fail mode.
Fail mode default: closed (503 while Redis is unreachable), the policies package's default: exact limits
and budgets are the point; an operator who prefers availability sets `--quota-fail-mode open`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gateway.admission.gates import FairQueueGate, GatedAdmission, QuotaGate
from policies import (
    FailoverConfig,
    FailoverQuotaBackend,
    FailureMode,
    FairQueue,
    FairQueueConfig,
    MemoryQuotaBackend,
    QuotaBackend,
    QuotaConfig,
    RedisQuotaBackend,
    SqliteUsageLedger,
)

FAIL_MODES = {"open": FailureMode.FAIL_OPEN, "closed": FailureMode.FAIL_CLOSED}
LEDGER_FILE = "quota_ledger.db"


@dataclass(frozen=True)
class QuotaSettings:
    queue_capacity: int  # requests the worker(s) run at once (the worker's max_num_seqs)
    fail_mode: str = "closed"  # "open" | "closed": what happens while Redis is unreachable
    fail_open_fraction: float = 1.0  # fail-open: share of each tenant's limits one replica enforces
    lease_ttl_s: float = 30.0  # a dead gateway's concurrency leases expire after this
    queue_timeout_s: float = 30.0  # longest wait in the fair queue before 503
    max_total_queued: int = 1024
    quantum_tokens: int = 256  # DRR quantum at weight 1; near a typical request's tokens keeps turns short
    redis_timeout_s: float = 0.5  # per Redis call; past it the store counts as unreachable

    def __post_init__(self) -> None:
        if self.queue_capacity < 1:
            raise ValueError(f"queue_capacity must be >= 1, got {self.queue_capacity}")
        if self.fail_mode not in FAIL_MODES:
            raise ValueError(f"fail_mode must be one of {sorted(FAIL_MODES)}, got {self.fail_mode!r}")
        if not 0.0 < self.fail_open_fraction <= 1.0:
            raise ValueError(f"fail_open_fraction must be in (0, 1], got {self.fail_open_fraction}")
        for name in ("lease_ttl_s", "queue_timeout_s", "redis_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_total_queued < 0 or self.quantum_tokens < 1:
            raise ValueError("max_total_queued must be >= 0 and quantum_tokens >= 1")


def build_quota_backend(settings: QuotaSettings, *, redis_url: str | None = None,
                        data_dir: Path | None = None) -> QuotaBackend:
    """Redis-backed (with failover) when `redis_url` is set, else in memory with the ledger in `data_dir`
    (no ledger, so budgets restart from zero, when `data_dir` is None)."""
    config = QuotaConfig(lease_ttl_s=settings.lease_ttl_s)
    if redis_url:
        shared = RedisQuotaBackend.from_url(redis_url, config, timeout_s=settings.redis_timeout_s)
        return FailoverQuotaBackend(shared, FailoverConfig(mode=FAIL_MODES[settings.fail_mode],
                                                           local_limit_fraction=settings.fail_open_fraction),
                                    quota_config=config)
    ledger = SqliteUsageLedger(data_dir / LEDGER_FILE) if data_dir is not None else None
    return MemoryQuotaBackend(config, ledger=ledger)


def build_admission(settings: QuotaSettings, quota: QuotaBackend) -> GatedAdmission:
    """The gates in order: the quota (rate limits, budgets, concurrency lease), then the fair queue."""
    queue = FairQueue(FairQueueConfig(capacity=settings.queue_capacity, max_total_queued=settings.max_total_queued,
                                      quantum_tokens=settings.quantum_tokens,
                                      default_timeout_s=settings.queue_timeout_s))
    return GatedAdmission([QuotaGate(quota), FairQueueGate(queue, settings.queue_timeout_s)], queue=queue)
