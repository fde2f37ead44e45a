"""QuotaBackend on Redis, shared by every gateway replica: limits hold in total, not per replica.

Each operation is one Lua script (policies.redis_scripts), so admit checks every limit and takes all of
them or nothing, atomically with respect to every other replica. Keys (one hash tag per tenant):
    {prefix}:{tenant}:req / :tok            bucket hashes {level, ts}, expire once full again
    {prefix}:{tenant}:leases                zset lease id -> expiry (unix s); expired members are purged
    {prefix}:{tenant}:budget:d:YYYY-MM-DD   tokens booked that UTC day   (kept 8 days past the period)
    {prefix}:{tenant}:budget:m:YYYY-MM      tokens booked that UTC month (kept 35 days past the period)
    {prefix}:{tenant}:lease:{id}            reservation record for reconcile (kept 2 days)
Durability of budget counters is Redis's: run it with appendonly yes (docker-compose.yml should).
Every replica must use the same QuotaConfig.lease_ttl_s.

The client is built without automatic retries on ambiguous failures: a retried admit whose first attempt
reached Redis would count twice. Connection errors propagate (see policies.failover).
"""

from __future__ import annotations

import time
import uuid

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from policies import redis_scripts
from policies.quota import (
    Admission,
    BudgetPeriods,
    Lease,
    QuotaBackend,
    QuotaConfig,
    RateLimitSnapshot,
    RefusalReason,
    TenantUsage,
    TokenBucket,
    refusal_message,
)
from policies.tenant_policy import TenantPolicy

DAY_KEY_GRACE_S = 8 * 86_400
MONTH_KEY_GRACE_S = 35 * 86_400
LEASE_RECORD_TTL_S = 2 * 86_400


def _bucket_view(capacity: int, level: float) -> TokenBucket:
    return TokenBucket(capacity=capacity, level=level, updated_at=0.0)


class RedisQuotaBackend(QuotaBackend):
    def __init__(self, client: aioredis.Redis, config: QuotaConfig | None = None) -> None:
        self.config = config or QuotaConfig()
        self._client = client
        self._admit = client.register_script(redis_scripts.ADMIT)
        self._reconcile = client.register_script(redis_scripts.RECONCILE)
        self._renew = client.register_script(redis_scripts.RENEW)
        self._usage = client.register_script(redis_scripts.USAGE)

    @classmethod
    def from_url(cls, url: str, config: QuotaConfig | None = None, timeout_s: float = 1.0) -> RedisQuotaBackend:
        """A backend with its own connection pool. One retry, only for a connection that fails before
        sending (a pooled connection gone stale after a Redis restart)."""
        client = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), retries=1, supported_errors=(RedisConnectionError,)),
        )
        return cls(client, config)

    def _key(self, tenant_id: str, suffix: str) -> str:
        return f"{self.config.key_prefix}:{{{tenant_id}}}:{suffix}"

    @staticmethod
    def _now_arg(now: float | None) -> str:
        return "" if now is None else repr(float(now))

    async def admit(self, tenant_id: str, policy: TenantPolicy, prompt_tokens: int, max_tokens: int,
                    now: float | None = None) -> Admission:
        reservation = policy.check_request_size(prompt_tokens, max_tokens)
        # NOTE: budget periods follow the local clock even when buckets use Redis time; they differ only
        # for requests within clock skew of midnight UTC.
        periods = BudgetPeriods.at(time.time() if now is None else now)
        lease_id = uuid.uuid4().hex
        ttl = self.config.lease_ttl_s
        keys = [self._key(tenant_id, "req"), self._key(tenant_id, "tok"), self._key(tenant_id, "leases"),
                self._key(tenant_id, f"budget:{periods.day}"), self._key(tenant_id, f"budget:{periods.month}"),
                self._key(tenant_id, f"lease:{lease_id}")]
        args: list[str | int | float] = [
            self._now_arg(now), policy.requests_per_minute, policy.tokens_per_minute,
            policy.max_concurrent_requests, reservation,
            -1 if policy.daily_token_budget is None else policy.daily_token_budget,
            -1 if policy.monthly_token_budget is None else policy.monthly_token_budget,
            lease_id, repr(ttl), repr(periods.seconds_to_day_end), repr(periods.seconds_to_month_end),
            repr(self.config.concurrency_retry_after_s),
            int(periods.seconds_to_day_end) + DAY_KEY_GRACE_S,
            int(periods.seconds_to_month_end) + MONTH_KEY_GRACE_S, LEASE_RECORD_TTL_S,
        ]
        granted, reason, retry_after, rq_level, tk_level, _ = await self._admit(keys=keys, args=args)
        requests = _bucket_view(policy.requests_per_minute, float(rq_level))
        tokens = _bucket_view(policy.tokens_per_minute, float(tk_level))
        snapshot = RateLimitSnapshot(
            limit_requests=requests.capacity, remaining_requests=requests.remaining(),
            reset_requests_s=requests.reset_seconds(), limit_tokens=tokens.capacity,
            remaining_tokens=tokens.remaining(), reset_tokens_s=tokens.reset_seconds(),
        )
        if int(granted) == 1:
            lease = Lease(lease_id=lease_id, tenant_id=tenant_id, reserved_tokens=reservation,
                          tokens_per_minute=policy.tokens_per_minute, day=periods.day, month=periods.month,
                          ttl_s=ttl)
            return Admission(snapshot=snapshot, lease=lease)
        refusal = RefusalReason(reason.decode() if isinstance(reason, bytes) else reason)
        retry = float(retry_after)
        return Admission(snapshot=snapshot, reason=refusal, retry_after_s=retry,
                         message=refusal_message(refusal, policy, reservation, retry))

    async def reconcile(self, lease: Lease, actual_total_tokens: int, now: float | None = None) -> bool:
        if actual_total_tokens < 0:
            raise ValueError(f"actual_total_tokens must be >= 0, got {actual_total_tokens}")
        keys = [self._key(lease.tenant_id, "tok"), self._key(lease.tenant_id, f"lease:{lease.lease_id}"),
                self._key(lease.tenant_id, f"budget:{lease.day}"),
                self._key(lease.tenant_id, f"budget:{lease.month}")]
        settled = await self._reconcile(
            keys=keys, args=[self._now_arg(now), actual_total_tokens, lease.tokens_per_minute]
        )
        return int(settled) == 1

    async def release(self, lease: Lease) -> bool:
        removed = await self._client.zrem(self._key(lease.tenant_id, "leases"), lease.lease_id)
        return int(removed) == 1

    async def renew(self, lease: Lease, now: float | None = None) -> bool:
        renewed = await self._renew(keys=[self._key(lease.tenant_id, "leases")],
                                    args=[self._now_arg(now), lease.lease_id, repr(lease.ttl_s)])
        return int(renewed) == 1

    async def usage(self, tenant_id: str, now: float | None = None) -> TenantUsage:
        periods = BudgetPeriods.at(time.time() if now is None else now)
        live, day_tokens, month_tokens = await self._usage(
            keys=[self._key(tenant_id, "leases"), self._key(tenant_id, f"budget:{periods.day}"),
                  self._key(tenant_id, f"budget:{periods.month}")],
            args=[self._now_arg(now)],
        )
        return TenantUsage(tenant_id=tenant_id, day=periods.day, day_tokens=int(day_tokens),
                           month=periods.month, month_tokens=int(month_tokens), in_flight=int(live))

    async def close(self) -> None:
        await self._client.aclose()
