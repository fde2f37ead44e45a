"""The shared store: one Redis server (or Sentinel-managed primary) behind all gateway replicas.

Multi-key writes are Lua scripts (atomic on the server), so replicas never see half a write. The
redis-py client pools connections and is thread-safe; one RedisStore per process is enough.
Durability is the server's: configure AOF (`appendonly yes`) if usage and audit must survive a restart.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from gateway.store import redis_scripts
from gateway.store.base import AdapterLimitExceeded, AdapterLimits, Store, require
from gateway.store.errors import AlreadyExistsError, NotFoundError
from gateway.store.models import (
    AdapterRecord,
    AdapterTotals,
    ApiKey,
    AuditEntry,
    RequestRecord,
    Tenant,
    UsageTotals,
    check_sha256,
)
from gateway.store.redis_keys import RedisKeys
from gateway.store.request_records import record_from_json, record_json
from gateway.store.stored_policy import read_policy
from gateway.store.usage_buckets import DAY, floor_to

USAGE_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")


@dataclass(frozen=True)
class RedisOptions:
    key_prefix: str = "loraplex:"
    socket_timeout_s: float = 5.0  # a call on a dead server fails after this long instead of hanging

    def __post_init__(self) -> None:
        RedisKeys(self.key_prefix)  # validates the prefix
        if not self.socket_timeout_s > 0:
            raise ValueError(f"socket_timeout_s must be positive, got {self.socket_timeout_s!r}")


def as_dict(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def optional_float(fields: dict[str, str], name: str) -> float | None:
    return float(fields[name]) if name in fields else None


def tenant_from_hash(h: dict[str, str]) -> Tenant:
    policy, problem = read_policy(h["id"], h["policy"])
    return Tenant(id=h["id"], name=h["name"], created_at=float(h["created_at"]), suspended=h["suspended"] == "1",
                  policy=policy, cache_salt=h["cache_salt"], shared=h["shared"] == "1", policy_error=problem)


def key_from_hash(h: dict[str, str]) -> ApiKey:
    return ApiKey(id=h["id"], tenant_id=h["tenant_id"], prefix=h["prefix"], hash=h["hash"],
                  scopes=frozenset(json.loads(h["scopes"])), created_at=float(h["created_at"]), name=h["name"],
                  expires_at=optional_float(h, "expires_at"), revoked_at=optional_float(h, "revoked_at"),
                  last_used_at=optional_float(h, "last_used_at"))


def adapter_from_hash(h: dict[str, str]) -> AdapterRecord:
    return AdapterRecord(
        tenant_id=h["tenant_id"], name=h["name"], version=int(h["version"]), sha256=h["sha256"],
        rank=int(h["rank"]), target_modules=tuple(json.loads(h["target_modules"])),
        size_bytes=int(h["size_bytes"]), description=h["description"], created_at=float(h["created_at"]),
        deleted_at=optional_float(h, "deleted_at"), shared=h["shared"] == "1",
    )


def usage_from_hash(h: dict[str, str]) -> UsageTotals:
    return UsageTotals(*(int(h.get(f, 0)) for f in USAGE_FIELDS))


def flag(value: bool) -> str:
    return "1" if value else "0"


class RedisStore(Store):
    def __init__(self, url: str, options: RedisOptions | None = None) -> None:
        self.options = options or RedisOptions()
        self.keys = RedisKeys(self.options.key_prefix)
        # Any: redis-py's annotations do not narrow replies to str under decode_responses=True.
        self._redis: Any = redis.Redis.from_url(
            url, decode_responses=True, socket_timeout=self.options.socket_timeout_s,
            socket_connect_timeout=self.options.socket_timeout_s,
        )
        self._scripts = {
            name: self._redis.register_script(getattr(redis_scripts, name))
            for name in ("CREATE_TENANT", "UPDATE_TENANT", "CREATE_KEY", "REVOKE_KEY", "FIND_KEY",
                         "ADD_ADAPTER_VERSION", "DELETE_ADAPTER", "SET_ADAPTER_SHARED", "INCREMENT_USAGE",
                         "APPEND_AUDIT")
        }

    def _run(self, script: str, keys: list[str], args: Sequence[str | int | float]) -> Any:
        return self._scripts[script](keys=keys, args=args)

    def close(self) -> None:
        self._redis.close()

    def ping(self) -> None:
        self._redis.ping()

    # ---- tenants ---------------------------------------------------------------------------------

    def _insert_tenant(self, tenant: Tenant, policy_json: str) -> None:
        fields = ["id", tenant.id, "name", tenant.name, "created_at", repr(tenant.created_at), "suspended", "0",
                  "policy", policy_json, "cache_salt", tenant.cache_salt, "shared", flag(tenant.shared)]
        created = self._run("CREATE_TENANT", [self.keys.tenant_by_name, self.keys.tenant(tenant.id)],
                            [tenant.name, tenant.id, *fields])
        if not created:
            raise AlreadyExistsError(f"a tenant named {tenant.name!r} already exists")

    def get_tenant(self, tenant_id: str) -> Tenant | None:
        h = self._redis.hgetall(self.keys.tenant(tenant_id))
        return tenant_from_hash(h) if h else None

    def get_tenant_by_name(self, name: str) -> Tenant | None:
        tenant_id = self._redis.hget(self.keys.tenant_by_name, name)
        return None if tenant_id is None else self.get_tenant(tenant_id)

    def list_tenants(self) -> list[Tenant]:
        hashes = self._hgetall_many(self.keys.tenant(i) for i in self._redis.hvals(self.keys.tenant_by_name))
        return sorted((tenant_from_hash(h) for h in hashes), key=lambda t: (t.created_at, t.name))

    def _hgetall_many(self, keys: Iterable[str]) -> list[dict[str, str]]:
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        return [h for h in pipe.execute() if h]

    def _update_tenant(
        self, tenant_id: str, *, policy_json: str | None = None, suspended: bool | None = None,
        shared: bool | None = None,
    ) -> tuple[Tenant, Tenant]:
        fields: list[str] = []
        if policy_json is not None:
            fields += ["policy", policy_json]
        if suspended is not None:
            fields += ["suspended", flag(suspended)]
        if shared is not None:
            fields += ["shared", flag(shared)]
        reply = require("tenant", tenant_id, self._run("UPDATE_TENANT", [self.keys.tenant(tenant_id)], fields))
        return tenant_from_hash(as_dict(reply[0])), tenant_from_hash(as_dict(reply[1]))

    # ---- API keys --------------------------------------------------------------------------------

    def _insert_api_key(self, key: ApiKey) -> None:
        fields = ["id", key.id, "tenant_id", key.tenant_id, "prefix", key.prefix, "hash", key.hash,
                  "scopes", json.dumps(sorted(key.scopes)), "name", key.name, "created_at", repr(key.created_at)]
        if key.expires_at is not None:
            fields += ["expires_at", repr(key.expires_at)]
        keys = [self.keys.tenant(key.tenant_id), self.keys.key(key.id), self.keys.key_by_hash,
                self.keys.keys_of(key.tenant_id), self.keys.keys_of(None)]
        if not self._run("CREATE_KEY", keys, [key.hash, key.id, *fields]):
            raise NotFoundError("tenant", key.tenant_id)

    def get_api_key(self, key_id: str) -> ApiKey | None:
        h = self._redis.hgetall(self.keys.key(key_id))
        return key_from_hash(h) if h else None

    def list_api_keys(self, tenant_id: str | None = None) -> list[ApiKey]:
        ids = self._redis.smembers(self.keys.keys_of(tenant_id))
        keys = (key_from_hash(h) for h in self._hgetall_many(self.keys.key(i) for i in ids))
        return sorted(keys, key=lambda k: (k.created_at, k.id))

    def _revoke_api_key(self, key_id: str, now: float) -> ApiKey:
        reply = self._run("REVOKE_KEY", [self.keys.key(key_id)], [repr(now)])
        return key_from_hash(as_dict(require("API key", key_id, reply)))

    def _find_key_by_hash(self, key_hash: str) -> tuple[ApiKey, Tenant] | None:
        reply = self._run("FIND_KEY", [self.keys.key_by_hash],
                          [key_hash, self.keys.key_prefix, self.keys.tenant_prefix])
        if not reply or not reply[1]:
            return None
        return key_from_hash(as_dict(reply[0])), tenant_from_hash(as_dict(reply[1]))

    def _touch_api_key(self, key_id: str, now: float) -> None:
        self._redis.hset(self.keys.key(key_id), "last_used_at", repr(now))

    # ---- adapters --------------------------------------------------------------------------------

    def _insert_adapter_version(self, draft: AdapterRecord, limits: AdapterLimits | None) -> int:
        t = draft.tenant_id
        keys = [self.keys.tenant(t), self.keys.adapter_versions(t), self.keys.adapters_of(t), self.keys.sha_refs,
                self.keys.adapter_totals(t), self.keys.adapters_shared]
        fields: list[str | int] = ["tenant_id", t, "name", draft.name, "sha256", draft.sha256, "rank", draft.rank,
                  "target_modules", json.dumps(list(draft.target_modules)), "size_bytes", draft.size_bytes,
                  "description", draft.description, "created_at", repr(draft.created_at),
                  "shared", flag(draft.shared)]
        bounds = (limits.max_count, limits.max_bytes) if limits is not None else (-1, -1)
        args: list[str | int] = [draft.name, self.keys.adapter_base(t, draft.name), draft.sha256,
                                 draft.size_bytes, flag(draft.shared), *bounds, *fields]
        version = self._run("ADD_ADAPTER_VERSION", keys, args)
        if isinstance(version, list):  # refused by a limit: {-1 | -2, count, bytes}
            assert limits is not None
            code, count, size = (int(v) for v in version)
            raise AdapterLimitExceeded("count" if code == -1 else "bytes", AdapterTotals(count, size), limits)
        if not version:
            raise NotFoundError("tenant", t)
        return int(version)

    def get_adapter(
        self, tenant_id: str, name: str, version: int | None = None, *, include_deleted: bool = False
    ) -> AdapterRecord | None:
        base = self.keys.adapter_base(tenant_id, name)
        if version is not None:
            candidates = [version]
        else:
            last = int(self._redis.hget(self.keys.adapter_versions(tenant_id), name) or 0)
            candidates = list(range(last, 0, -1))
        for v in candidates:  # newest first; usually the first one is live
            h = self._redis.hgetall(f"{base}{v}")
            if h and (include_deleted or "deleted_at" not in h):
                return adapter_from_hash(h)
        return None

    def list_adapters(
        self, tenant_id: str, *, include_shared: bool = True, include_deleted: bool = False
    ) -> list[AdapterRecord]:
        record_keys = set(self._redis.smembers(self.keys.adapters_of(tenant_id)))
        if include_shared:
            record_keys |= self._redis.smembers(self.keys.adapters_shared)
        records = [adapter_from_hash(h) for h in self._hgetall_many(sorted(record_keys))]
        # Other tenants' records come only from the shared set, which holds live versions only.
        visible = [r for r in records if r.tenant_id != tenant_id or include_deleted or r.deleted_at is None]
        return sorted(visible, key=lambda r: (r.tenant_id, r.name, r.version))

    def _delete_adapter(self, tenant_id: str, name: str, now: float) -> int:
        keys = [self.keys.adapter_versions(tenant_id), self.keys.sha_refs, self.keys.adapter_totals(tenant_id),
                self.keys.adapters_shared]
        return int(self._run("DELETE_ADAPTER", keys, [name, self.keys.adapter_base(tenant_id, name), repr(now)]))

    def set_adapter_shared(self, tenant_id: str, name: str, shared: bool) -> int:
        keys = [self.keys.adapter_versions(tenant_id), self.keys.adapters_shared]
        return int(self._run("SET_ADAPTER_SHARED", keys, [name, self.keys.adapter_base(tenant_id, name), flag(shared)]))

    def is_sha_referenced(self, sha256: str) -> bool:
        return int(self._redis.hget(self.keys.sha_refs, check_sha256(sha256)) or 0) > 0

    def adapter_totals(self, tenant_id: str) -> AdapterTotals:
        count, size = self._redis.hmget(self.keys.adapter_totals(tenant_id), ["count", "bytes"])
        return AdapterTotals(count=int(count or 0), size_bytes=int(size or 0))

    # ---- usage -----------------------------------------------------------------------------------

    def _increment_usage(self, tenant_id: str, at: float, hour_start: int, counts: UsageTotals) -> None:
        keys = [self.keys.tenant(tenant_id), self.keys.usage_hours(tenant_id),
                self.keys.usage_hour(tenant_id, hour_start), self.keys.usage_day(tenant_id, floor_to(at, DAY))]
        args = [hour_start, counts.requests, counts.prompt_tokens, counts.completion_tokens, counts.cached_tokens]
        if not self._run("INCREMENT_USAGE", keys, args):
            raise NotFoundError("tenant", tenant_id)

    def _usage_hours(self, tenant_id: str, lo: int, hi: int) -> list[tuple[int, UsageTotals]]:
        starts = [int(s) for s in self._redis.zrangebyscore(self.keys.usage_hours(tenant_id), lo, f"({hi}")]
        pipe = self._redis.pipeline(transaction=False)
        for start in starts:
            pipe.hgetall(self.keys.usage_hour(tenant_id, start))
        return [(start, usage_from_hash(h)) for start, h in zip(starts, pipe.execute(), strict=True)]

    def day_totals(self, tenant_id: str, at: float | None = None) -> UsageTotals:
        """One read of the day counter (kept in the same script that bumps the hour)."""
        day = floor_to(self._now(at), DAY)
        return usage_from_hash(self._redis.hgetall(self.keys.usage_day(tenant_id, day)))

    # ---- request records -------------------------------------------------------------------------

    def _insert_requests(self, tenant_id: str, records: list[RequestRecord], cutoff: float, keep_s: float) -> None:
        # NOTE: tenants are never deleted, so the check and the MULTI below cannot race a deletion.
        if not self._redis.exists(self.keys.tenant(tenant_id)):
            raise NotFoundError("tenant", tenant_id)
        ttl = max(1, math.ceil(keep_s))
        indexes = {self.keys.requests_by_time(tenant_id)}
        pipe = self._redis.pipeline(transaction=True)
        for r in records:
            pipe.set(self.keys.request(tenant_id, r.request_id), record_json(r), ex=ttl)
            pipe.zadd(self.keys.requests_by_time(tenant_id), {r.request_id: r.created_at})
            if r.user is not None:
                indexes.add(self.keys.requests_of_user(tenant_id, r.user))
                pipe.zadd(self.keys.requests_of_user(tenant_id, r.user), {r.request_id: r.created_at})
        for index in indexes:  # an index of an end user who sends nothing more expires with its last record
            pipe.zremrangebyscore(index, "-inf", f"({cutoff!r}")
            pipe.expire(index, ttl)
        pipe.execute()

    def _select_requests(self, tenant_id: str, user: str | None, since: float | None, before: float | None,
                         limit: int) -> list[RequestRecord]:
        index = self.keys.requests_by_time(tenant_id) if user is None else self.keys.requests_of_user(tenant_id, user)
        upper = "+inf" if before is None else f"({before!r}"
        lower = "-inf" if since is None else repr(since)
        ids = self._redis.zrevrangebyscore(index, upper, lower, start=0, num=limit)
        if not ids:
            return []
        texts = self._redis.mget([self.keys.request(tenant_id, i) for i in ids])
        return [record_from_json(t) for t in texts if t is not None]  # None: expired, index not pruned yet

    # ---- audit -----------------------------------------------------------------------------------

    def _insert_audit(
        self, at: float, actor: str, action: str, target: str, before_json: str, after_json: str
    ) -> int:
        entry = json.dumps([repr(at), actor, action, target, before_json, after_json])
        keys = [self.keys.audit_next, self.keys.audit_ids, self.keys.audit_entries]
        return int(self._run("APPEND_AUDIT", keys, [entry]))

    def _select_audit(self, limit: int, before_id: int | None) -> list[AuditEntry]:
        upper = "+inf" if before_id is None else f"({before_id}"
        ids = self._redis.zrevrangebyscore(self.keys.audit_ids, upper, "-inf", start=0, num=limit)
        if not ids:
            return []
        entries = []
        for entry_id, text in zip(ids, self._redis.hmget(self.keys.audit_entries, ids), strict=True):
            at, actor, action, target, before_json, after_json = json.loads(text)
            entries.append(AuditEntry(int(entry_id), float(at), actor, action, target,
                                      json.loads(before_json), json.loads(after_json)))
        return entries
