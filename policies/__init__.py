"""Tenant limits, quota accounting (memory and Redis behind one interface), failover, and the fair queue.

Gateway wiring, per request (gateway/admission/ composes these steps as ordered gates):
    policy = tenant.policy                                             # one TenantPolicy, parsed by the store
    priority = policy.resolve_priority(body.priority)                  # PriorityNotAllowed -> 400
    admission = await quota.admit(tenant, policy, prompt_tokens, max_tokens)   # RequestTooLarge -> 400,
    headers = admission_headers(admission)                             # QuotaUnavailable -> 503
    if not admission.granted: 429 with headers and refusal_body(admission)
    ticket = await queue.acquire(tenant, priority, policy.fair_share_weight, reservation,
                                 timeout, max_queued=policy.max_queued_requests)  # QueueFull / QueueTimeout
    ... run, renewing admission.lease every lease.ttl_s / 3 ...
    queue.release(ticket, actual_tokens); await quota.reconcile(lease, actual_tokens); await quota.release(lease)
"""

from policies.failover import FailoverConfig, FailoverQuotaBackend, FailureMode
from policies.fair_queue import FairQueue, FairQueueConfig, QueueFull, QueueTimeout, Ticket
from policies.headers import admission_headers, refusal_body, retry_after_headers, unavailable_body
from policies.memory_quota import MemoryQuotaBackend
from policies.quota import (
    Admission,
    Lease,
    QuotaBackend,
    QuotaConfig,
    QuotaUnavailable,
    RateLimitSnapshot,
    RefusalReason,
    TenantUsage,
)
from policies.redis_quota import RedisQuotaBackend
from policies.tenant_policy import InvalidPolicy, PriorityNotAllowed, RequestTooLarge, TenantPolicy
from policies.usage_ledger import SqliteUsageLedger, UsageLedger

__all__ = [
    "Admission", "FailoverConfig", "FailoverQuotaBackend", "FailureMode", "FairQueue", "FairQueueConfig",
    "InvalidPolicy", "Lease", "MemoryQuotaBackend", "PriorityNotAllowed", "QueueFull", "QueueTimeout", "QuotaBackend",
    "QuotaConfig", "QuotaUnavailable", "RateLimitSnapshot", "RedisQuotaBackend", "RefusalReason",
    "RequestTooLarge", "SqliteUsageLedger", "TenantPolicy", "TenantUsage", "Ticket", "UsageLedger",
    "admission_headers", "refusal_body", "retry_after_headers", "unavailable_body",
]
