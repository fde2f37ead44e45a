"""The embedded store: one SQLite file in the data directory, WAL mode, shared by threads and processes."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

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
from gateway.store.request_records import SQLITE_COLUMNS, record_from_row, record_row
from gateway.store.sqlite_connections import SqliteConnections, SqliteOptions
from gateway.store.sqlite_schema import prepare_database
from gateway.store.stored_policy import read_policy

KEY_COLUMNS = "k.id, k.tenant_id, k.prefix, k.hash, k.scopes, k.name, k.created_at, k.expires_at, " \
    "k.revoked_at, k.last_used_at"
TENANT_COLUMNS = "t.id, t.name, t.created_at, t.suspended, t.policy, t.cache_salt, t.shared"


def tenant_from_row(row: sqlite3.Row | tuple, offset: int = 0) -> Tenant:
    r = tuple(row)[offset:offset + 7]
    policy, problem = read_policy(r[0], r[4])
    return Tenant(id=r[0], name=r[1], created_at=r[2], suspended=bool(r[3]), policy=policy,
                  cache_salt=r[5], shared=bool(r[6]), policy_error=problem)


def key_from_row(row: sqlite3.Row | tuple) -> ApiKey:
    r = tuple(row)[:10]
    return ApiKey(id=r[0], tenant_id=r[1], prefix=r[2], hash=r[3], scopes=frozenset(json.loads(r[4])),
                  name=r[5], created_at=r[6], expires_at=r[7], revoked_at=r[8], last_used_at=r[9])


def adapter_from_row(row: sqlite3.Row) -> AdapterRecord:
    return AdapterRecord(
        tenant_id=row["tenant_id"], name=row["name"], version=row["version"], sha256=row["sha256"],
        rank=row["rank"], target_modules=tuple(json.loads(row["target_modules"])),
        size_bytes=row["size_bytes"], description=row["description"], created_at=row["created_at"],
        deleted_at=row["deleted_at"], shared=bool(row["shared"]),
    )


def create_private_file(path: Path) -> None:
    """Make `path` readable by its owner alone (0600; new parent directories 0700) before SQLite opens
    it: SQLite gives its -wal and -shm files the database file's mode. An existing file is narrowed."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    os.chmod(path, 0o600)


class SqliteStore(Store):
    """Store in the SQLite file at `path` (created with its parent directory if missing).

    Every write is one `BEGIN IMMEDIATE` transaction, so it is atomic against other threads and other
    processes on the same file; reads of several rows run in one read transaction.
    """

    def __init__(self, path: str | Path, options: SqliteOptions | None = None) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise ValueError(f"store path {self.path} is a directory; name a file such as {self.path / 'store.db'}")
        create_private_file(self.path)
        self._db = SqliteConnections(self.path, options or SqliteOptions())
        with self._db.borrow() as conn:
            prepare_database(conn)

    def close(self) -> None:
        self._db.close()

    def ping(self) -> None:
        with self._db.borrow() as conn:
            conn.execute("SELECT 1").fetchone()

    # ---- tenants ---------------------------------------------------------------------------------

    def _insert_tenant(self, tenant: Tenant, policy_json: str) -> None:
        try:
            with self._db.write() as conn:
                conn.execute(
                    "INSERT INTO tenants (id, name, created_at, suspended, policy, cache_salt, shared) "
                    "VALUES (?, ?, ?, 0, ?, ?, ?)",
                    (tenant.id, tenant.name, tenant.created_at, policy_json, tenant.cache_salt, int(tenant.shared)),
                )
        except sqlite3.IntegrityError:
            raise AlreadyExistsError(f"a tenant named {tenant.name!r} already exists") from None

    def _tenant_where(self, conn: sqlite3.Connection, clause: str, arg: str) -> Tenant | None:
        row = conn.execute(f"SELECT {TENANT_COLUMNS} FROM tenants t WHERE {clause}", (arg,)).fetchone()
        return None if row is None else tenant_from_row(row)

    def get_tenant(self, tenant_id: str) -> Tenant | None:
        with self._db.borrow() as conn:
            return self._tenant_where(conn, "t.id = ?", tenant_id)

    def get_tenant_by_name(self, name: str) -> Tenant | None:
        with self._db.borrow() as conn:
            return self._tenant_where(conn, "t.name = ?", name)

    def list_tenants(self) -> list[Tenant]:
        with self._db.borrow() as conn:
            rows = conn.execute(f"SELECT {TENANT_COLUMNS} FROM tenants t ORDER BY t.created_at, t.name").fetchall()
        return [tenant_from_row(r) for r in rows]

    def _update_tenant(
        self, tenant_id: str, *, policy_json: str | None = None, suspended: bool | None = None,
        shared: bool | None = None,
    ) -> tuple[Tenant, Tenant]:
        with self._db.write() as conn:
            before = require("tenant", tenant_id, self._tenant_where(conn, "t.id = ?", tenant_id))
            conn.execute(
                "UPDATE tenants SET policy = coalesce(?, policy), suspended = coalesce(?, suspended), "
                "shared = coalesce(?, shared) WHERE id = ?",
                (policy_json, None if suspended is None else int(suspended),
                 None if shared is None else int(shared), tenant_id),
            )
            after = self._tenant_where(conn, "t.id = ?", tenant_id)
        return before, after  # type: ignore[return-value]

    # ---- API keys --------------------------------------------------------------------------------

    def _insert_api_key(self, key: ApiKey) -> None:
        with self._db.write() as conn:
            require("tenant", key.tenant_id, self._tenant_where(conn, "t.id = ?", key.tenant_id))
            conn.execute(
                "INSERT INTO api_keys (id, tenant_id, prefix, hash, scopes, name, created_at, expires_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (key.id, key.tenant_id, key.prefix, key.hash, json.dumps(sorted(key.scopes)), key.name,
                 key.created_at, key.expires_at),
            )

    def get_api_key(self, key_id: str) -> ApiKey | None:
        with self._db.borrow() as conn:
            row = conn.execute(f"SELECT {KEY_COLUMNS} FROM api_keys k WHERE k.id = ?", (key_id,)).fetchone()
        return None if row is None else key_from_row(row)

    def list_api_keys(self, tenant_id: str | None = None) -> list[ApiKey]:
        where, args = ("WHERE k.tenant_id = ?", (tenant_id,)) if tenant_id is not None else ("", ())
        with self._db.borrow() as conn:
            rows = conn.execute(
                f"SELECT {KEY_COLUMNS} FROM api_keys k {where} ORDER BY k.created_at, k.id", args
            ).fetchall()
        return [key_from_row(r) for r in rows]

    def _revoke_api_key(self, key_id: str, now: float) -> ApiKey:
        with self._db.write() as conn:
            conn.execute("UPDATE api_keys SET revoked_at = coalesce(revoked_at, ?) WHERE id = ?", (now, key_id))
            row = conn.execute(f"SELECT {KEY_COLUMNS} FROM api_keys k WHERE k.id = ?", (key_id,)).fetchone()
        return key_from_row(require("API key", key_id, row))

    def _find_key_by_hash(self, key_hash: str) -> tuple[ApiKey, Tenant] | None:
        with self._db.borrow() as conn:
            row = conn.execute(
                f"SELECT {KEY_COLUMNS}, {TENANT_COLUMNS} FROM api_keys k JOIN tenants t ON t.id = k.tenant_id "
                "WHERE k.hash = ?",
                (key_hash,),
            ).fetchone()
        return None if row is None else (key_from_row(row), tenant_from_row(row, offset=10))

    def _touch_api_key(self, key_id: str, now: float) -> None:
        with self._db.write() as conn:
            conn.execute(
                "UPDATE api_keys SET last_used_at = ? WHERE id = ? AND (last_used_at IS NULL OR last_used_at < ?)",
                (now, key_id, now),
            )

    # ---- adapters --------------------------------------------------------------------------------

    def _insert_adapter_version(self, draft: AdapterRecord, limits: AdapterLimits | None) -> int:
        with self._db.write() as conn:  # BEGIN IMMEDIATE: the limit check and the insert are one transaction
            require("tenant", draft.tenant_id, self._tenant_where(conn, "t.id = ?", draft.tenant_id))
            if limits is not None:
                totals = _adapter_totals(conn, draft.tenant_id)
                if totals.count + 1 > limits.max_count:
                    raise AdapterLimitExceeded("count", totals, limits)
                if totals.size_bytes + draft.size_bytes > limits.max_bytes:
                    raise AdapterLimitExceeded("bytes", totals, limits)
            version = conn.execute(
                "INSERT INTO adapter_names (tenant_id, name, last_version) VALUES (?, ?, 1) "
                "ON CONFLICT (tenant_id, name) DO UPDATE SET last_version = last_version + 1 "
                "RETURNING last_version",
                (draft.tenant_id, draft.name),
            ).fetchone()[0]
            conn.execute(
                "INSERT INTO adapters (tenant_id, name, version, sha256, rank, target_modules, size_bytes, "
                "description, created_at, shared) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (draft.tenant_id, draft.name, version, draft.sha256, draft.rank,
                 json.dumps(list(draft.target_modules)), draft.size_bytes, draft.description,
                 draft.created_at, int(draft.shared)),
            )
        return version

    def get_adapter(
        self, tenant_id: str, name: str, version: int | None = None, *, include_deleted: bool = False
    ) -> AdapterRecord | None:
        live = "" if include_deleted else " AND deleted_at IS NULL"
        with self._db.borrow() as conn:
            if version is None:
                row = conn.execute(
                    f"SELECT * FROM adapters WHERE tenant_id = ? AND name = ?{live} ORDER BY version DESC LIMIT 1",
                    (tenant_id, name),
                ).fetchone()
            else:
                row = conn.execute(
                    f"SELECT * FROM adapters WHERE tenant_id = ? AND name = ? AND version = ?{live}",
                    (tenant_id, name, version),
                ).fetchone()
        return None if row is None else adapter_from_row(row)

    def list_adapters(
        self, tenant_id: str, *, include_shared: bool = True, include_deleted: bool = False
    ) -> list[AdapterRecord]:
        own = "tenant_id = ?" + ("" if include_deleted else " AND deleted_at IS NULL")
        shared = " OR (shared = 1 AND deleted_at IS NULL)" if include_shared else ""
        with self._db.borrow() as conn:
            rows = conn.execute(
                f"SELECT * FROM adapters WHERE ({own}){shared} ORDER BY tenant_id, name, version", (tenant_id,)
            ).fetchall()
        return [adapter_from_row(r) for r in rows]

    def _delete_adapter(self, tenant_id: str, name: str, now: float) -> int:
        with self._db.write() as conn:
            return conn.execute(
                "UPDATE adapters SET deleted_at = ? WHERE tenant_id = ? AND name = ? AND deleted_at IS NULL",
                (now, tenant_id, name),
            ).rowcount

    def set_adapter_shared(self, tenant_id: str, name: str, shared: bool) -> int:
        with self._db.write() as conn:
            return conn.execute(
                "UPDATE adapters SET shared = ? WHERE tenant_id = ? AND name = ? AND deleted_at IS NULL "
                "AND shared != ?",
                (int(shared), tenant_id, name, int(shared)),
            ).rowcount

    def is_sha_referenced(self, sha256: str) -> bool:
        check_sha256(sha256)
        with self._db.borrow() as conn:
            row = conn.execute(
                "SELECT 1 FROM adapters WHERE sha256 = ? AND deleted_at IS NULL LIMIT 1", (sha256,)
            ).fetchone()
        return row is not None

    def adapter_totals(self, tenant_id: str) -> AdapterTotals:
        with self._db.borrow() as conn:
            return _adapter_totals(conn, tenant_id)

    # ---- usage -----------------------------------------------------------------------------------

    def _increment_usage(self, tenant_id: str, at: float, hour_start: int, counts: UsageTotals) -> None:
        try:
            with self._db.write() as conn:
                conn.execute(
                    "INSERT INTO usage_hours (tenant_id, hour_start, requests, prompt_tokens, completion_tokens, "
                    "cached_tokens) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (tenant_id, hour_start) DO UPDATE SET "
                    "requests = requests + excluded.requests, prompt_tokens = prompt_tokens + excluded.prompt_tokens, "
                    "completion_tokens = completion_tokens + excluded.completion_tokens, "
                    "cached_tokens = cached_tokens + excluded.cached_tokens",
                    (tenant_id, hour_start, counts.requests, counts.prompt_tokens, counts.completion_tokens,
                     counts.cached_tokens),
                )
        except sqlite3.IntegrityError:  # the foreign key on tenant_id
            raise NotFoundError("tenant", tenant_id) from None

    def _usage_hours(self, tenant_id: str, lo: int, hi: int) -> list[tuple[int, UsageTotals]]:
        with self._db.borrow() as conn:
            rows = conn.execute(
                "SELECT hour_start, requests, prompt_tokens, completion_tokens, cached_tokens FROM usage_hours "
                "WHERE tenant_id = ? AND hour_start >= ? AND hour_start < ? ORDER BY hour_start",
                (tenant_id, lo, hi),
            ).fetchall()
        return [(r[0], UsageTotals(r[1], r[2], r[3], r[4])) for r in rows]

    # ---- request records -------------------------------------------------------------------------

    def _insert_requests(self, tenant_id: str, records: list[RequestRecord], cutoff: float, keep_s: float) -> None:
        with self._db.write() as conn:
            require("tenant", tenant_id, self._tenant_where(conn, "t.id = ?", tenant_id))
            conn.executemany(f"INSERT OR REPLACE INTO request_records ({', '.join(SQLITE_COLUMNS)}) "
                             f"VALUES ({', '.join('?' * len(SQLITE_COLUMNS))})", [record_row(r) for r in records])
            conn.execute("DELETE FROM request_records WHERE tenant_id = ? AND created_at < ?", (tenant_id, cutoff))

    def _select_requests(self, tenant_id: str, user: str | None, since: float | None, before: float | None,
                         limit: int) -> list[RequestRecord]:
        where, args = ["tenant_id = ?"], list[str | float]([tenant_id])
        for clause, value in (("end_user = ?", user), ("created_at >= ?", since), ("created_at < ?", before)):
            if value is not None:
                where.append(clause)
                args.append(value)
        with self._db.borrow() as conn:
            rows = conn.execute(
                f"SELECT {', '.join(SQLITE_COLUMNS)} FROM request_records WHERE {' AND '.join(where)} "
                "ORDER BY created_at DESC, seq DESC LIMIT ?", (*args, limit),
            ).fetchall()
        return [record_from_row(r) for r in rows]

    # ---- audit -----------------------------------------------------------------------------------

    def _insert_audit(
        self, at: float, actor: str, action: str, target: str, before_json: str, after_json: str
    ) -> int:
        with self._db.write() as conn:
            cursor = conn.execute(
                "INSERT INTO audit_log (at, actor, action, target, before, after) VALUES (?, ?, ?, ?, ?, ?)",
                (at, actor, action, target, before_json, after_json),
            )
            return int(cursor.lastrowid)  # type: ignore[arg-type]

    def _select_audit(self, limit: int, before_id: int | None) -> list[AuditEntry]:
        with self._db.borrow() as conn:
            rows = conn.execute(
                "SELECT id, at, actor, action, target, before, after FROM audit_log WHERE id < ? "
                "ORDER BY id DESC LIMIT ?",
                (before_id if before_id is not None else 2**63 - 1, limit),
            ).fetchall()
        return [AuditEntry(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]), json.loads(r[6])) for r in rows]


def _adapter_totals(conn: sqlite3.Connection, tenant_id: str) -> AdapterTotals:
    count, size = conn.execute(
        "SELECT count(*), coalesce(sum(size_bytes), 0) FROM adapters WHERE tenant_id = ? AND deleted_at IS NULL",
        (tenant_id,),
    ).fetchone()
    return AdapterTotals(count=count, size_bytes=size)
