"""Where the Redis store keeps each record. Every key starts with a prefix (default "loraplex:").

    tenant:{id}                   hash   id name created_at suspended policy cache_salt shared
    tenant_by_name                hash   name -> tenant id (HSETNX makes names unique)
    key:{id}                      hash   id tenant_id prefix hash scopes name created_at
                                         [expires_at] [revoked_at] [last_used_at]
    key_by_hash                   hash   sha256 of plaintext -> key id
    keys / keys:{tenant}          set    key ids (all / per tenant)
    adapter:{tenant}:{name}:{v}   hash   one version; `deleted_at` present once soft-deleted
    adapter_versions:{tenant}     hash   name -> last version handed out (survives deletes)
    adapters:{tenant}             set    record keys of the tenant's versions
    adapters_shared               set    record keys of live shared versions (any tenant)
    sha_refs                      hash   sha256 -> number of live versions pointing at it
    adapter_totals:{tenant}       hash   count, bytes of live versions
    usage:{tenant}:hours          zset   hour starts that have a counter hash (score = member)
    usage:{tenant}:h:{start}      hash   requests prompt_tokens completion_tokens cached_tokens
    usage:{tenant}:d:{start}      hash   same, per UTC day (kept beside hours: one read for "today")
    audit:next                    string last audit id handed out
    audit:ids / audit:entries     zset / hash   id -> JSON [at, actor, action, target, before, after]
    request:{tenant}:{request}    string JSON of one RequestRecord, expires after the retention period
    requests:{tenant}:t           zset   request ids by created_at (pruned to the retention period on write)
    requests:{tenant}:u:{user}    zset   the same, of one end user (`user`: any string, last in the key)

Tenant ids, names and adapter names never contain ':' (see models.check_name), so keys cannot collide.
NOTE: the Lua scripts build record keys from a prefix passed in ARGV, which is fine on a standalone
or Sentinel-managed Redis but not on Redis Cluster.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RedisKeys:
    prefix: str = "loraplex:"

    def __post_init__(self) -> None:
        if not self.prefix or any(c.isspace() for c in self.prefix):
            raise ValueError(f"Redis key prefix must be non-empty without whitespace, got {self.prefix!r}")

    def tenant(self, tenant_id: str) -> str:
        return f"{self.prefix}tenant:{tenant_id}"

    @property
    def tenant_prefix(self) -> str:
        return f"{self.prefix}tenant:"

    @property
    def tenant_by_name(self) -> str:
        return f"{self.prefix}tenant_by_name"

    def key(self, key_id: str) -> str:
        return f"{self.prefix}key:{key_id}"

    @property
    def key_prefix(self) -> str:
        return f"{self.prefix}key:"

    @property
    def key_by_hash(self) -> str:
        return f"{self.prefix}key_by_hash"

    def keys_of(self, tenant_id: str | None) -> str:
        return f"{self.prefix}keys" if tenant_id is None else f"{self.prefix}keys:{tenant_id}"

    def adapter_base(self, tenant_id: str, name: str) -> str:
        """Record key without the version: append the version number."""
        return f"{self.prefix}adapter:{tenant_id}:{name}:"

    def adapter_versions(self, tenant_id: str) -> str:
        return f"{self.prefix}adapter_versions:{tenant_id}"

    def adapters_of(self, tenant_id: str) -> str:
        return f"{self.prefix}adapters:{tenant_id}"

    @property
    def adapters_shared(self) -> str:
        return f"{self.prefix}adapters_shared"

    @property
    def sha_refs(self) -> str:
        return f"{self.prefix}sha_refs"

    def adapter_totals(self, tenant_id: str) -> str:
        return f"{self.prefix}adapter_totals:{tenant_id}"

    def usage_hours(self, tenant_id: str) -> str:
        return f"{self.prefix}usage:{tenant_id}:hours"

    def usage_hour(self, tenant_id: str, hour_start: int) -> str:
        return f"{self.prefix}usage:{tenant_id}:h:{hour_start}"

    def usage_day(self, tenant_id: str, day_start: int) -> str:
        return f"{self.prefix}usage:{tenant_id}:d:{day_start}"

    def request(self, tenant_id: str, request_id: str) -> str:
        return f"{self.prefix}request:{tenant_id}:{request_id}"

    def requests_by_time(self, tenant_id: str) -> str:
        return f"{self.prefix}requests:{tenant_id}:t"

    def requests_of_user(self, tenant_id: str, user: str) -> str:
        return f"{self.prefix}requests:{tenant_id}:u:{user}"

    @property
    def audit_next(self) -> str:
        return f"{self.prefix}audit:next"

    @property
    def audit_ids(self) -> str:
        return f"{self.prefix}audit:ids"

    @property
    def audit_entries(self) -> str:
        return f"{self.prefix}audit:entries"
