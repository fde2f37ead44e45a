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
                 rate:         requests bucket holds >= 1 and tokens bucket holds >= R (policies.token_bucket)
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

from abc import ABC, abstractmethod
from dataclasses import dataclass
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
