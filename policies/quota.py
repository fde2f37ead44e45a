"""Quota accounting interface: admit (reserve everything or nothing), reconcile, release, renew, usage.

One request's life against a QuotaBackend:
    admission = await quota.admit(tenant, policy, prompt_tokens, max_tokens)
    if not admission.granted: answer 429 (policies.headers builds headers and body)
    ... while running, every lease.ttl_s / 3:  await quota.renew(admission.lease)
    await quota.reconcile(admission.lease, actual_total_tokens)   # true prompt + completion tokens
    await quota.release(admission.lease)                          # idempotent; also on abort/error

Semantics of admit (atomic per tenant, across every replica sharing the backend):
    reservation R = prompt_tokens + max_tokens (must be <= policy.max_tokens_per_request, else RequestTooLarge)
    granted iff  budgets:      day_used + R <= daily_token_budget and month_used + R <= monthly_token_budget
                 rate:         requests bucket holds >= 1 and tokens bucket holds >= R (policies.quota)
                 concurrency:  live leases < max_concurrent_requests (expired leases do not count)
    on grant: take 1 request, R tokens, book R to the day and month budgets, add a lease expiring after ttl.
    on refusal: nothing changes. The refusal reason is the first failing group in the order above
    (budgets → insufficient_quota; rate or concurrency → rate_limit_exceeded), retry_after_s is when that
    request could first succeed (period end for budgets, bucket wait for rates, a configured hint for
    concurrency), never earlier.
reconcile(lease, actual): refunds R - actual (or surcharges if negative) to the tokens bucket and to the
    budget periods the reservation was booked under. Applied at most once per lease.
A gateway that dies leaves its reservation charged (nothing counted is lost) and its lease expires by ttl.

`now` is unix seconds; None means the backend's clock (the Redis backend then uses Redis server time for
buckets and leases, so replicas with skewed clocks still agree).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum

from policies.tenant_policy import TenantPolicy


class RefusalReason(StrEnum):
    REQUESTS = "requests"
    TOKENS = "tokens"
    CONCURRENCY = "concurrency"
    DAILY_BUDGET = "daily_budget"
    MONTHLY_BUDGET = "monthly_budget"

    @property
    def error_code(self) -> str:
        """OpenAI's error code for a 429 with this reason."""
        if self in (RefusalReason.DAILY_BUDGET, RefusalReason.MONTHLY_BUDGET):
            return "insufficient_quota"
        return "rate_limit_exceeded"


class QuotaUnavailable(RuntimeError):
    """The shared quota store cannot be reached and the backend fails closed (gateway answers 503)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class QuotaConfig:
    """Backend settings (not per tenant)."""

    lease_ttl_s: float = 30.0  # a lease not renewed for this long is freed (dead gateway)
    concurrency_retry_after_s: float = 1.0  # retry hint when only the concurrency limit refused
    key_prefix: str = "loraplex:quota"  # Redis key namespace

    def __post_init__(self) -> None:
        if self.lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {self.lease_ttl_s}")
        if self.concurrency_retry_after_s <= 0:
            raise ValueError(f"concurrency_retry_after_s must be > 0, got {self.concurrency_retry_after_s}")
        if not self.key_prefix or any(c in self.key_prefix for c in "{} "):
            raise ValueError(f"key_prefix must be non-empty without braces or spaces, got {self.key_prefix!r}")


@dataclass(frozen=True)
class RateLimitSnapshot:
    """Bucket state after the decision, for the x-ratelimit-* headers. Reset values are seconds."""

    limit_requests: int
    remaining_requests: int
    reset_requests_s: float
    limit_tokens: int
    remaining_tokens: int
    reset_tokens_s: float


@dataclass(frozen=True)
class Lease:
    """What a granted request holds; pass it back to reconcile, renew and release."""

    lease_id: str
    tenant_id: str
    reserved_tokens: int
    tokens_per_minute: int  # the bucket capacity at admission, needed to reconcile
    day: str  # budget period keys the reservation was booked under
    month: str
    ttl_s: float
    origin: str = "primary"  # which backend granted it ("local" for a fail-open grant)


@dataclass(frozen=True)
class Admission:
    """Either granted (lease set) or refused (reason set, retry_after_s > 0)."""

    snapshot: RateLimitSnapshot
    lease: Lease | None = None
    reason: RefusalReason | None = None
    retry_after_s: float = 0.0
    message: str = ""

    def __post_init__(self) -> None:
        if (self.lease is None) == (self.reason is None):
            raise ValueError("an Admission has exactly one of lease (granted) or reason (refused)")
        if self.reason is not None and self.retry_after_s <= 0:
            raise ValueError(f"a refusal needs retry_after_s > 0, got {self.retry_after_s}")

    @property
    def granted(self) -> bool:
        return self.lease is not None


@dataclass(frozen=True)
class TenantUsage:
    """Tokens booked in the current UTC day and month (reservations until reconciled) and live leases."""

    tenant_id: str
    day: str
    day_tokens: int
    month: str
    month_tokens: int
    in_flight: int


class QuotaBackend(ABC):
    """Quota accounting shared by every gateway replica that uses the same store."""

    @abstractmethod
    async def admit(self, tenant_id: str, policy: TenantPolicy, prompt_tokens: int, max_tokens: int,
                    now: float | None = None) -> Admission:
        """Check every limit and take all of them, or take nothing. Raises RequestTooLarge."""

    @abstractmethod
    async def reconcile(self, lease: Lease, actual_total_tokens: int, now: float | None = None) -> bool:
        """Settle the reservation with the true token count. False if already settled (no-op)."""

    @abstractmethod
    async def release(self, lease: Lease) -> bool:
        """Free the concurrency lease. Idempotent: False when it was already gone."""

    @abstractmethod
    async def renew(self, lease: Lease, now: float | None = None) -> bool:
        """Extend the lease by its ttl. False when it already expired or was released."""

    @abstractmethod
    async def usage(self, tenant_id: str, now: float | None = None) -> TenantUsage:
        """Current usage; does not modify anything."""

    def stats(self) -> dict[str, int | bool]:
        """Counters of the backend's own state (failover outages, ...); the default has none."""
        return {}

    async def close(self) -> None:
        """Release connections and wait for pending writes; the default holds none."""
        return None


def refusal_message(reason: RefusalReason, policy: TenantPolicy, reservation: int,
                    retry_after_s: float) -> str:
    """Human-readable refusal in the style of OpenAI's 429 messages."""
    limits = {
        RefusalReason.REQUESTS: ("requests per min (RPM)", policy.requests_per_minute, 1),
        RefusalReason.TOKENS: ("tokens per min (TPM)", policy.tokens_per_minute, reservation),
        RefusalReason.CONCURRENCY: ("concurrent requests", policy.max_concurrent_requests, 1),
        RefusalReason.DAILY_BUDGET: ("tokens per day", policy.daily_token_budget, reservation),
        RefusalReason.MONTHLY_BUDGET: ("tokens per month", policy.monthly_token_budget, reservation),
    }
    what, limit, requested = limits[reason]
    if reason.error_code == "insufficient_quota":
        return (f"You exceeded your token budget of {limit} {what} (requested {requested}). "
                f"It renews in {retry_after_s:.0f}s.")
    return f"Rate limit reached on {what}: limit {limit}, requested {requested}. Please try again in " \
           f"{retry_after_s:.3f}s."


def choose_refusal(budget_day_fails: bool, budget_month_fails: bool, seconds_to_day_end: float,
                   seconds_to_month_end: float, requests_wait_s: float, tokens_wait_s: float,
                   concurrency_full: bool, concurrency_retry_after_s: float
                   ) -> tuple[RefusalReason, float] | None:
    """The refusal (reason, retry_after_s) for a set of failing checks, None if all pass (order above)."""
    if budget_month_fails:
        return RefusalReason.MONTHLY_BUDGET, seconds_to_month_end
    if budget_day_fails:
        return RefusalReason.DAILY_BUDGET, seconds_to_day_end
    if requests_wait_s > 0 or tokens_wait_s > 0:
        reason = RefusalReason.REQUESTS if requests_wait_s >= tokens_wait_s else RefusalReason.TOKENS
        wait = max(requests_wait_s, tokens_wait_s)
        if concurrency_full:
            wait = max(wait, concurrency_retry_after_s)
        return reason, wait
    if concurrency_full:
        return RefusalReason.CONCURRENCY, concurrency_retry_after_s
    return None


SECONDS_PER_MINUTE = 60.0


@dataclass
class TokenBucket:
    """The token bucket both quota backends share (the Redis Lua scripts implement the same arithmetic).

    Semantics:
        capacity  C = the per-minute limit;  rate r = C / 60 per second;  a new bucket starts full (level = C).
        refill:   level(now) = min(C, level(ts) + (now - ts) * r)        (time never runs backwards: now >= ts)
        take n:   allowed iff level(now) >= n; then level -= n            (all-or-nothing)
        give n:   level = min(C, level + n)    (reconcile refund);  debt: level may go down to -C on a surcharge
        wait(n):  (n - level) / r seconds until n could be taken (0 if it can now)
        reset:    (C - level) / r seconds until the bucket is full again  (OpenAI's x-ratelimit-reset-*)
        remaining: floor(max(level, 0))

        Hence k requests of cost 1 arriving within a span of d seconds against a full bucket are admitted
        exactly min(k, C + floor(d * r)) times; e.g. 90 requests within 2 s at 30/min: exactly 30.
    """

    """Mutable bucket state. `level` and `updated_at` are what the Redis hash stores."""

    capacity: int
    level: float
    updated_at: float

    @classmethod
    def full(cls, capacity: int, now: float) -> TokenBucket:
        if capacity < 1:
            raise ValueError(f"bucket capacity must be >= 1, got {capacity}")
        return cls(capacity=capacity, level=float(capacity), updated_at=now)

    @property
    def rate_per_second(self) -> float:
        return self.capacity / SECONDS_PER_MINUTE

    def refill(self, now: float, capacity: int) -> None:
        """Advance to `now` under a (possibly changed) capacity. Mutates level, updated_at, capacity."""
        self.capacity = capacity
        elapsed = max(0.0, now - self.updated_at)
        self.level = min(float(capacity), self.level + elapsed * self.rate_per_second)
        self.updated_at = max(self.updated_at, now)

    def can_take(self, amount: int) -> bool:
        return self.level >= amount

    def take(self, amount: int) -> None:
        if not self.can_take(amount):
            raise ValueError(f"bucket holds {self.level:.3f}, cannot take {amount}")
        self.level -= amount

    def adjust(self, refund: int) -> None:
        """Give back `refund` (negative = surcharge). Level stays within [-capacity, capacity]."""
        self.level = max(-float(self.capacity), min(float(self.capacity), self.level + refund))

    def wait_seconds(self, amount: int) -> float:
        return max(0.0, (amount - self.level) / self.rate_per_second)

    def reset_seconds(self) -> float:
        return max(0.0, (self.capacity - self.level) / self.rate_per_second)

    def remaining(self) -> int:
        return max(0, math.floor(self.level))


@dataclass(frozen=True)
class BudgetPeriods:
    """UTC budget periods: the key a token count is booked under and the time until the period ends.
    """

    """The day and month a moment falls in, as storage keys, and seconds until each one ends."""

    day: str  # "d:2025-01-31"
    month: str  # "m:2025-01"
    seconds_to_day_end: float
    seconds_to_month_end: float

    @classmethod
    def at(cls, now: float) -> BudgetPeriods:
        """Periods containing the unix time `now` (UTC calendar)."""
        moment = datetime.fromtimestamp(now, tz=UTC)
        day_start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
        next_day = day_start + timedelta(days=1)
        month_start = day_start.replace(day=1)
        next_month = (month_start + timedelta(days=32)).replace(day=1)
        return cls(
            day=f"d:{moment:%Y-%m-%d}",
            month=f"m:{moment:%Y-%m}",
            seconds_to_day_end=next_day.timestamp() - now,
            seconds_to_month_end=next_month.timestamp() - now,
        )
