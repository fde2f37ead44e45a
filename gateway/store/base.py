"""The `Store` interface: tenants, API keys, adapter records, usage and the audit log.

Public methods validate their arguments, stamp times and ids, and delegate to a handful of `_`
primitives that each backend (SQLite, Redis) implements atomically. Every method is synchronous and
thread-safe; one instance is meant to be shared by all threads of a process, and several processes (or
gateway replicas) may open the same file or server at once.

Cost: reads are one indexed SQLite query (tens of µs) or one Redis round trip; writes are one SQLite
transaction (may wait up to the busy timeout while another process writes) or one Redis round trip.
An async caller can call reads directly; writes belong in a thread (`run_in_threadpool`).

`now` / `at` arguments are POSIX seconds and default to `time.time()`; tests pass them explicitly.
"""

from __future__ import annotations

import json
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from gateway.store.api_keys import generate_api_key, hash_api_key, hashes_match, looks_like_api_key
from gateway.store.errors import NotFoundError, StoreError, TenantSuspendedError
from gateway.store.models import (
    AdapterRecord,
    AdapterTotals,
    ApiKey,
    AuditEntry,
    Authenticated,
    Granularity,
    RequestRecord,
    Tenant,
    UsageRow,
    UsageTotals,
    check_count,
    check_name,
    check_scopes,
    check_sha256,
    check_time,
    json_text,
)
from gateway.store.stored_policy import as_policy, policy_json
from gateway.store.usage_buckets import (
    HOUR,
    day_range,
    floor_to,
    group_hours,
    hour_span,
    sum_totals,
)
from policies.tenant_policy import TenantPolicy


@dataclass(frozen=True)
class AdapterLimits:
    """A tenant's adapter limits, checked by `add_adapter_version` in the same atomic write as the insert."""

    max_count: int  # live versions
    max_bytes: int  # their stored bytes

    def __post_init__(self) -> None:
        check_count("max_count", self.max_count)
        check_count("max_bytes", self.max_bytes)


class AdapterLimitExceeded(StoreError):
    """The new version would take the tenant over a limit (`exceeded`: "count" or "bytes"); `totals` are
    the tenant's live versions at that moment, which the write saw and left unchanged."""

    def __init__(self, exceeded: str, totals: AdapterTotals, limits: AdapterLimits) -> None:
        super().__init__(f"adapter {exceeded} limit reached ({totals}, {limits})")
        self.exceeded = exceeded
        self.totals = totals
        self.limits = limits


LAST_USED_RESOLUTION_S = 60.0  # authenticate writes last_used_at at most once a minute per key
MAX_AUDIT_PAGE = 1000
MAX_REQUESTS_PAGE = 1000
REQUEST_RECORD_RETENTION_S = 30 * 86400.0  # per-request records older than this are pruned on write


class Store(ABC):
    # NOTE: bumped after every change made through this object that can alter what `authenticate` answers
    # (revocation, suspension, policy, sharing), so caches of its answers (gateway/auth/backend.py) drop
    # what they took before. Changes by other processes or replicas are not seen here.
    auth_epoch: int = 0

    def _auth_changed(self) -> None:
        self.auth_epoch += 1

    # ---- lifecycle -------------------------------------------------------------------------------

    @abstractmethod
    def close(self) -> None:
        """Release connections. The data stays; reopen with `open_store`."""

    @abstractmethod
    def ping(self) -> None:
        """Raise if the backing file or server cannot be reached (readiness checks)."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _now(now: float | None) -> float:
        return time.time() if now is None else check_time("now", now)  # type: ignore[return-value]

    # ---- tenants ---------------------------------------------------------------------------------

    def create_tenant(
        self, name: str, *, policy: TenantPolicy | Mapping[str, Any] | None = None, shared: bool = False,
        now: float | None = None,
    ) -> Tenant:
        """A new active tenant with a fresh server-chosen cache salt. AlreadyExistsError if the name is taken;
        InvalidPolicy (a ValueError naming the field) if `policy` is a mapping that does not validate."""
        checked = as_policy(policy)
        tenant = Tenant(
            id="ten_" + secrets.token_hex(8), name=check_name("tenant", name), created_at=self._now(now),
            suspended=False, policy=checked, cache_salt=secrets.token_hex(16), shared=bool(shared),
        )
        self._insert_tenant(tenant, policy_json(checked))
        return tenant

    @abstractmethod
    def get_tenant(self, tenant_id: str) -> Tenant | None: ...

    @abstractmethod
    def get_tenant_by_name(self, name: str) -> Tenant | None: ...

    @abstractmethod
    def list_tenants(self) -> list[Tenant]:
        """All tenants, oldest first."""

    def update_policy(
        self, tenant_id: str, policy: TenantPolicy | Mapping[str, Any]
    ) -> tuple[TenantPolicy, TenantPolicy]:
        """Replace the tenant's policy; returns (before, after) for the audit log. NotFoundError if unknown,
        InvalidPolicy if `policy` is a mapping that does not validate."""
        before, after = self._update_tenant(tenant_id, policy_json=policy_json(as_policy(policy)))
        self._auth_changed()
        return before.policy, after.policy

    def set_suspended(self, tenant_id: str, suspended: bool) -> Tenant:
        """Suspend or resume; a suspended tenant's keys authenticate to TenantSuspendedError (403)."""
        tenant = self._update_tenant(tenant_id, suspended=bool(suspended))[1]
        self._auth_changed()
        return tenant

    def suspend_tenant(self, tenant_id: str) -> Tenant:
        return self.set_suspended(tenant_id, True)

    def resume_tenant(self, tenant_id: str) -> Tenant:
        return self.set_suspended(tenant_id, False)

    def set_tenant_shared(self, tenant_id: str, shared: bool) -> Tenant:
        tenant = self._update_tenant(tenant_id, shared=bool(shared))[1]
        self._auth_changed()
        return tenant

    # ---- API keys --------------------------------------------------------------------------------

    def create_api_key(
        self, tenant_id: str, *, scopes: frozenset[str] | set[str] = frozenset({"tenant"}), name: str = "",
        expires_at: float | None = None, now: float | None = None,
    ) -> tuple[str, ApiKey]:
        """A new key for the tenant: (plaintext, record). The plaintext is never stored: show it once."""
        if not isinstance(name, str) or len(name) > 200:
            raise ValueError("key name must be a string of at most 200 characters")
        plaintext, prefix, digest = generate_api_key()
        key = ApiKey(
            id="key_" + secrets.token_hex(8), tenant_id=tenant_id, prefix=prefix, hash=digest,
            scopes=check_scopes(scopes), created_at=self._now(now), name=name,
            expires_at=check_time("expires_at", expires_at),
        )
        self._insert_api_key(key)
        return plaintext, key

    @abstractmethod
    def get_api_key(self, key_id: str) -> ApiKey | None: ...

    @abstractmethod
    def list_api_keys(self, tenant_id: str | None = None) -> list[ApiKey]:
        """Keys of one tenant (or all), oldest first, revoked and expired ones included."""

    def revoke_api_key(self, key_id: str, *, now: float | None = None) -> ApiKey:
        """Revoke for good; revoking twice keeps the first time. NotFoundError if unknown."""
        key = self._revoke_api_key(key_id, self._now(now))
        self._auth_changed()
        return key

    def authenticate(self, plaintext: str, now: float | None = None) -> Authenticated | None:
        """Bearer token → (key, tenant), or None for unknown, revoked and expired keys (answer 401).

        A usable key of a suspended tenant raises TenantSuspendedError (answer 403). The lookup is by
        hash; the stored hash is then compared in constant time. Writes `last_used_at` at most once
        per LAST_USED_RESOLUTION_S per key, so most calls are read-only.
        """
        now = self._now(now)
        if not looks_like_api_key(plaintext):
            return None
        presented = hash_api_key(plaintext)
        found = self._find_key_by_hash(presented)
        if found is None:
            return None
        key, tenant = found
        if not hashes_match(key.hash, presented) or not key.is_usable(now):
            return None
        if tenant.suspended:
            raise TenantSuspendedError(key, tenant)
        if key.last_used_at is None or now - key.last_used_at >= LAST_USED_RESOLUTION_S:
            self._touch_api_key(key.id, now)
            key = replace(key, last_used_at=now)
        return Authenticated(key, tenant)

    # ---- adapters --------------------------------------------------------------------------------

    def add_adapter_version(
        self, tenant_id: str, name: str, sha256: str, *, rank: int, target_modules: tuple[str, ...] | list[str],
        size_bytes: int, description: str = "", shared: bool = False, now: float | None = None,
        limits: AdapterLimits | None = None,
    ) -> AdapterRecord:
        """Record a new version of the tenant's adapter `name`, numbered atomically: concurrent calls
        get distinct versions, and numbering continues after deleted versions. NotFoundError if the
        tenant is unknown. With `limits`, the check of the tenant's live count and bytes and the insert
        are one atomic write (a Redis script, a SQLite transaction): concurrent uploads through any
        number of gateways never take a tenant past them; AdapterLimitExceeded (nothing written) else."""
        modules = tuple(target_modules)
        if not modules or not all(isinstance(m, str) and m for m in modules):
            raise ValueError(f"target_modules must be a non-empty list of module names, got {target_modules!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be a positive int, got {rank!r}")
        if not isinstance(description, str):
            raise ValueError("description must be a string")
        draft = AdapterRecord(
            tenant_id=tenant_id, name=check_name("adapter", name), version=0, sha256=check_sha256(sha256),
            rank=rank, target_modules=modules, size_bytes=check_count("size_bytes", size_bytes),
            description=description, created_at=self._now(now), deleted_at=None, shared=bool(shared),
        )
        return replace(draft, version=self._insert_adapter_version(draft, limits))

    @abstractmethod
    def get_adapter(
        self, tenant_id: str, name: str, version: int | None = None, *, include_deleted: bool = False
    ) -> AdapterRecord | None:
        """The tenant's own adapter: the given version, or the latest live one when version is None."""

    @abstractmethod
    def list_adapters(
        self, tenant_id: str, *, include_shared: bool = True, include_deleted: bool = False
    ) -> list[AdapterRecord]:
        """Every version of the tenant's adapters, plus live shared ones of other tenants, ordered by
        (tenant_id, name, version)."""

    def delete_adapter(self, tenant_id: str, name: str, *, now: float | None = None) -> int:
        """Soft-delete every live version of `name`; returns how many were deleted (0 if none)."""
        return self._delete_adapter(tenant_id, name, self._now(now))

    @abstractmethod
    def set_adapter_shared(self, tenant_id: str, name: str, shared: bool) -> int:
        """Mark every live version of `name` shared (or not); returns how many versions changed state."""

    @abstractmethod
    def is_sha_referenced(self, sha256: str) -> bool:
        """True while any live version of any tenant points at this content (its file must stay)."""

    @abstractmethod
    def adapter_totals(self, tenant_id: str) -> AdapterTotals:
        """Count and bytes of the tenant's live versions, for quotas."""

    # ---- usage -----------------------------------------------------------------------------------

    def record_usage(
        self, tenant_id: str, at: float | None = None, requests: int = 1, prompt_tokens: int = 0,
        completion_tokens: int = 0, cached_tokens: int = 0,
    ) -> None:
        """Add to the tenant's counters for the UTC hour holding `at` (atomic increments).

        NotFoundError if the tenant is unknown.
        """
        at = self._now(at)
        counts = UsageTotals(
            check_count("requests", requests), check_count("prompt_tokens", prompt_tokens),
            check_count("completion_tokens", completion_tokens), check_count("cached_tokens", cached_tokens),
        )
        self._increment_usage(tenant_id, at, floor_to(at, HOUR), counts)

    def usage(self, tenant_id: str, since: float, until: float, granularity: Granularity = "hour") -> list[UsageRow]:
        """Rows of the UTC hours or days that overlap [since, until) and have any usage, oldest first."""
        since, until = check_time("since", since), check_time("until", until)  # type: ignore[assignment]
        lo, hi = hour_span(since, until, granularity)
        if since == until:
            return []
        return group_hours(tenant_id, self._usage_hours(tenant_id, lo, hi), granularity)

    def usage_totals(self, tenant_id: str, since: float, until: float) -> UsageTotals:
        """Sum over the hours that overlap [since, until)."""
        since, until = check_time("since", since), check_time("until", until)  # type: ignore[assignment]
        lo, hi = hour_span(since, until, "hour")
        if since == until:
            return UsageTotals()
        return sum_totals(counts for _, counts in self._usage_hours(tenant_id, lo, hi))

    def day_totals(self, tenant_id: str, at: float | None = None) -> UsageTotals:
        """Usage of the UTC day holding `at` (the admin API's "today"; budgets are the quota backend's)."""
        return self.usage_totals(tenant_id, *day_range(self._now(at)))

    # ---- request records -------------------------------------------------------------------------

    # Records created more than this before now are never listed, and are deleted by the next write.
    request_retention_s: float = REQUEST_RECORD_RETENTION_S

    def record_requests(self, tenant_id: str, records: list[RequestRecord], *, now: float | None = None) -> None:
        """Append the tenant's per-request records in one atomic write, and delete its records past the
        retention. Writing a record again (same request id) replaces it, so a retried batch is not counted
        twice. NotFoundError if the tenant is unknown; ValueError if a record is another tenant's."""
        for record in records:
            if record.tenant_id != tenant_id:
                raise ValueError(f"record {record.request_id} belongs to tenant {record.tenant_id}, not {tenant_id}")
        if records:
            self._insert_requests(tenant_id, records, self._now(now) - self.request_retention_s,
                                  self.request_retention_s)

    def list_requests(self, tenant_id: str, *, user: str | None = None, since: float | None = None,
                      before: float | None = None, limit: int = 50, now: float | None = None) -> list[RequestRecord]:
        """The tenant's request records within the retention, newest first: those of end user `user` only
        when given, created at or after `since` and strictly before `before` (a page's last `created_at`
        pages back; records created at the very same time may fall between two pages)."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_REQUESTS_PAGE:
            raise ValueError(f"limit must be an int in 1..{MAX_REQUESTS_PAGE}, got {limit!r}")
        if user is not None and (not isinstance(user, str) or not user):
            raise ValueError("user must be a non-empty string")
        oldest = self._now(now) - self.request_retention_s
        since = max(oldest, check_time("since", since) or oldest)
        return self._select_requests(tenant_id, user, since, check_time("before", before), limit)

    # ---- audit -----------------------------------------------------------------------------------

    def append_audit(
        self, actor: str, action: str, target: str, *, before: Any = None, after: Any = None,
        at: float | None = None,
    ) -> AuditEntry:
        """Append one entry; `before`/`after` are any JSON values (e.g. from update_policy)."""
        for what, value in (("actor", actor), ("action", action), ("target", target)):
            if not isinstance(value, str) or not value or len(value) > 500:
                raise ValueError(f"audit {what} must be a non-empty string of at most 500 characters")
        at = self._now(at)
        before_json, after_json = json_text("audit before", before), json_text("audit after", after)
        entry_id = self._insert_audit(at, actor, action, target, before_json, after_json)
        return AuditEntry(entry_id, at, actor, action, target, json.loads(before_json), json.loads(after_json))

    def list_audit(self, *, limit: int = 50, before_id: int | None = None) -> list[AuditEntry]:
        """Newest first; `before_id` pages back from an entry id (exclusive)."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_AUDIT_PAGE:
            raise ValueError(f"limit must be an int in 1..{MAX_AUDIT_PAGE}, got {limit!r}")
        if before_id is not None and (isinstance(before_id, bool) or not isinstance(before_id, int)):
            raise ValueError(f"before_id must be an int, got {before_id!r}")
        return self._select_audit(limit, before_id)

    # ---- backend primitives (each one atomic) ----------------------------------------------------

    @abstractmethod
    def _insert_tenant(self, tenant: Tenant, policy_json: str) -> None:
        """AlreadyExistsError if the name is taken."""

    @abstractmethod
    def _update_tenant(
        self, tenant_id: str, *, policy_json: str | None = None, suspended: bool | None = None,
        shared: bool | None = None,
    ) -> tuple[Tenant, Tenant]:
        """Set the given fields; returns (before, after). NotFoundError if unknown."""

    @abstractmethod
    def _insert_api_key(self, key: ApiKey) -> None:
        """NotFoundError if key.tenant_id is unknown."""

    @abstractmethod
    def _revoke_api_key(self, key_id: str, now: float) -> ApiKey: ...

    @abstractmethod
    def _find_key_by_hash(self, key_hash: str) -> tuple[ApiKey, Tenant] | None: ...

    @abstractmethod
    def _touch_api_key(self, key_id: str, now: float) -> None: ...

    @abstractmethod
    def _insert_adapter_version(self, draft: AdapterRecord, limits: AdapterLimits | None) -> int:
        """Store `draft` under the next version of (tenant, name); returns that version. With `limits`,
        checks them in the same atomic write: AdapterLimitExceeded, nothing written, when over."""

    @abstractmethod
    def _delete_adapter(self, tenant_id: str, name: str, now: float) -> int: ...

    @abstractmethod
    def _increment_usage(self, tenant_id: str, at: float, hour_start: int, counts: UsageTotals) -> None: ...

    @abstractmethod
    def _usage_hours(self, tenant_id: str, lo: int, hi: int) -> list[tuple[int, UsageTotals]]:
        """(hour_start, counters) for hours with lo <= hour_start < hi."""

    @abstractmethod
    def _insert_requests(self, tenant_id: str, records: list[RequestRecord], cutoff: float, keep_s: float) -> None:
        """Upsert `records` and delete the tenant's records created before `cutoff`, atomically."""

    @abstractmethod
    def _select_requests(self, tenant_id: str, user: str | None, since: float | None, before: float | None,
                         limit: int) -> list[RequestRecord]:
        """Newest first (ties: the later written first)."""

    @abstractmethod
    def _insert_audit(
        self, at: float, actor: str, action: str, target: str, before_json: str, after_json: str
    ) -> int: ...

    @abstractmethod
    def _select_audit(self, limit: int, before_id: int | None) -> list[AuditEntry]: ...


def require(kind: str, ident: str, value: Any) -> Any:
    """`value`, or NotFoundError when it is None (backends use it after lookups)."""
    if value is None:
        raise NotFoundError(kind, ident)
    return value
