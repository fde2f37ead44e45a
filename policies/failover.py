"""What quota admission does when the shared store (Redis) cannot be reached.

FailoverQuotaBackend wraps the shared backend and, on a connection error or timeout, either
    fail_closed  raises QuotaUnavailable: the gateway answers 503 with retry-after; or
    fail_open    admits against a local MemoryQuotaBackend of this replica, with each tenant's rate and
                 concurrency limits scaled by local_limit_fraction (set it to 1 / replicas to keep the
                 total near the configured limit). Budgets there count from this replica's own ledger
                 (none by default), so during an outage they are not enforced across replicas.
Every degraded admission is counted (`fallback_admissions`, `refused_unavailable`) and the first one of an
outage is logged at WARNING, recovery at INFO. While the store is down it is probed again at most once per
retry_interval_s; in between, requests go straight to the degraded path without waiting on a timeout.

Default: fail_closed. The limits this package exists for are the ones that leak when each replica enforces
its own copy (limit × replicas, budgets bypassed); failing open silently reintroduces exactly that, and a
budget is money. An operator who prefers availability over exact limits opts into fail_open knowingly.

Leases remember which backend granted them (Lease.origin), so reconcile/release/renew go to the same
place. Updates to the shared store that fail during an outage are dropped and counted (`lost_updates`):
an unreleased lease expires by its ttl and an unreconciled reservation stays charged (never under-counts).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from policies.memory_quota import MemoryQuotaBackend
from policies.quota import Admission, Lease, QuotaBackend, QuotaConfig, QuotaUnavailable, TenantUsage
from policies.tenant_policy import TenantPolicy

logger = logging.getLogger(__name__)

LOCAL_ORIGIN = "local"
T = TypeVar("T")


class FailureMode(StrEnum):
    FAIL_CLOSED = "fail_closed"
    FAIL_OPEN = "fail_open"


@dataclass(frozen=True)
class FailoverConfig:
    mode: FailureMode = FailureMode.FAIL_CLOSED
    retry_interval_s: float = 1.0  # while down, probe the shared store at most this often
    local_limit_fraction: float = 1.0  # fail_open: share of each tenant's limits this replica enforces
    unavailable_retry_after_s: float = 1.0  # fail_closed: retry-after of the 503

    def __post_init__(self) -> None:
        if not isinstance(self.mode, FailureMode):
            raise ValueError(f"mode must be one of {[m.value for m in FailureMode]}, got {self.mode!r}")
        if self.retry_interval_s < 0:
            raise ValueError(f"retry_interval_s must be >= 0, got {self.retry_interval_s}")
        if not 0.0 < self.local_limit_fraction <= 1.0:
            raise ValueError(f"local_limit_fraction must be in (0, 1], got {self.local_limit_fraction}")
        if self.unavailable_retry_after_s <= 0:
            raise ValueError(f"unavailable_retry_after_s must be > 0, got {self.unavailable_retry_after_s}")


class FailoverQuotaBackend(QuotaBackend):
    UNREACHABLE: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError, OSError)

    def __init__(self, shared: QuotaBackend, config: FailoverConfig | None = None, *,
                 quota_config: QuotaConfig | None = None, monotonic: Callable[[], float] = time.monotonic) -> None:
        """`quota_config` is the shared backend's (lease ttl, retry hints): the local fallback uses the same."""
        self.config = config or FailoverConfig()
        self._shared = shared
        self._local = MemoryQuotaBackend(quota_config, origin=LOCAL_ORIGIN)
        self._monotonic = monotonic
        self._down_until: float | None = None  # while set and in the future, skip the shared store
        self.fallback_admissions = 0
        self.refused_unavailable = 0
        self.lost_updates = 0
        self.outages = 0

    @property
    def degraded(self) -> bool:
        """True from the first failed call of an outage until the shared store answers again."""
        return self._down_until is not None

    async def _try_shared(self, call: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
        if self._down_until is not None and self._monotonic() < self._down_until:
            return False, None
        try:
            result = await call()
        except self.UNREACHABLE as error:
            if self._down_until is None:
                self.outages += 1
                logger.warning("quota store unreachable (%s): failing %s", error,
                               "open to per-replica limits" if self.config.mode is FailureMode.FAIL_OPEN
                               else "closed (503)")
            self._down_until = self._monotonic() + self.config.retry_interval_s
            return False, None
        if self._down_until is not None:
            logger.info("quota store reachable again; shared limits enforced")
            self._down_until = None
        return True, result

    async def admit(self, tenant_id: str, policy: TenantPolicy, prompt_tokens: int, max_tokens: int,
                    now: float | None = None) -> Admission:
        policy.check_request_size(prompt_tokens, max_tokens)
        ok, admission = await self._try_shared(
            lambda: self._shared.admit(tenant_id, policy, prompt_tokens, max_tokens, now))
        if ok and admission is not None:
            return admission
        if self.config.mode is FailureMode.FAIL_CLOSED:
            self.refused_unavailable += 1
            raise QuotaUnavailable("quota store unreachable; refusing requests (fail-closed mode)",
                                   self.config.unavailable_retry_after_s)
        self.fallback_admissions += 1
        fraction = self.config.local_limit_fraction
        local_policy = policy if fraction == 1.0 else policy.scaled(fraction)
        return await self._local.admit(tenant_id, local_policy, prompt_tokens, max_tokens, now)

    async def _update_shared(self, call: Callable[[], Awaitable[bool]]) -> bool:
        ok, result = await self._try_shared(call)
        if not ok:
            self.lost_updates += 1
        return bool(result)

    async def reconcile(self, lease: Lease, actual_total_tokens: int, now: float | None = None) -> bool:
        if lease.origin == LOCAL_ORIGIN:
            return await self._local.reconcile(lease, actual_total_tokens, now)
        return await self._update_shared(lambda: self._shared.reconcile(lease, actual_total_tokens, now))

    async def release(self, lease: Lease) -> bool:
        if lease.origin == LOCAL_ORIGIN:
            return await self._local.release(lease)
        return await self._update_shared(lambda: self._shared.release(lease))

    async def renew(self, lease: Lease, now: float | None = None) -> bool:
        if lease.origin == LOCAL_ORIGIN:
            return await self._local.renew(lease, now)
        return await self._update_shared(lambda: self._shared.renew(lease, now))

    async def usage(self, tenant_id: str, now: float | None = None) -> TenantUsage:
        ok, usage = await self._try_shared(lambda: self._shared.usage(tenant_id, now))
        if ok and usage is not None:
            return usage
        if self.config.mode is FailureMode.FAIL_CLOSED:
            raise QuotaUnavailable("quota store unreachable; usage unknown", self.config.unavailable_retry_after_s)
        return await self._local.usage(tenant_id, now)

    def stats(self) -> dict[str, int | bool]:
        return {"degraded": self.degraded, "outages": self.outages, "fallback_admissions": self.fallback_admissions,
                "refused_unavailable": self.refused_unavailable, "lost_updates": self.lost_updates}

    async def close(self) -> None:
        await self._shared.close()
        await self._local.close()
