"""Tables of the SQLite store, created on first open. `PRAGMA user_version` holds the schema version."""

from __future__ import annotations

import sqlite3

SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL UNIQUE,
    created_at  REAL NOT NULL,
    suspended   INTEGER NOT NULL DEFAULT 0,
    policy      TEXT NOT NULL,              -- JSON object, opaque to the store
    cache_salt  TEXT NOT NULL,
    shared      INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS api_keys (
    id           TEXT PRIMARY KEY,
    tenant_id    TEXT NOT NULL REFERENCES tenants(id),
    prefix       TEXT NOT NULL,
    hash         TEXT NOT NULL UNIQUE,      -- sha256 hex of the plaintext
    scopes       TEXT NOT NULL,             -- JSON list
    name         TEXT NOT NULL,
    created_at   REAL NOT NULL,
    expires_at   REAL,
    revoked_at   REAL,
    last_used_at REAL
);
CREATE INDEX IF NOT EXISTS api_keys_by_tenant ON api_keys (tenant_id);
-- The version counter outlives deleted versions, so numbering continues after a delete.
CREATE TABLE IF NOT EXISTS adapter_names (
    tenant_id    TEXT NOT NULL REFERENCES tenants(id),
    name         TEXT NOT NULL,
    last_version INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, name)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS adapters (
    tenant_id      TEXT NOT NULL,
    name           TEXT NOT NULL,
    version        INTEGER NOT NULL,
    sha256         TEXT NOT NULL,
    rank           INTEGER NOT NULL,
    target_modules TEXT NOT NULL,           -- JSON list
    size_bytes     INTEGER NOT NULL,
    description    TEXT NOT NULL,
    created_at     REAL NOT NULL,
    deleted_at     REAL,
    shared         INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, name, version),
    FOREIGN KEY (tenant_id, name) REFERENCES adapter_names (tenant_id, name)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS live_adapters_by_sha ON adapters (sha256) WHERE deleted_at IS NULL;
CREATE INDEX IF NOT EXISTS live_shared_adapters ON adapters (shared) WHERE shared = 1 AND deleted_at IS NULL;
CREATE TABLE IF NOT EXISTS usage_hours (
    tenant_id         TEXT NOT NULL REFERENCES tenants(id),
    hour_start        INTEGER NOT NULL,     -- POSIX seconds, multiple of 3600
    requests          INTEGER NOT NULL,
    prompt_tokens     INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cached_tokens     INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, hour_start)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS audit_log (
    id     INTEGER PRIMARY KEY AUTOINCREMENT,
    at     REAL NOT NULL,
    actor  TEXT NOT NULL,
    action TEXT NOT NULL,
    target TEXT NOT NULL,
    before TEXT NOT NULL,                   -- JSON
    after  TEXT NOT NULL                    -- JSON
);
-- One row per served request (gateway/store/models.py RequestRecord), pruned after a retention period.
CREATE TABLE IF NOT EXISTS request_records (
    seq               INTEGER PRIMARY KEY AUTOINCREMENT,  -- write order: breaks created_at ties
    tenant_id         TEXT NOT NULL REFERENCES tenants(id),
    request_id        TEXT NOT NULL,
    created_at        REAL NOT NULL,
    key_id            TEXT NOT NULL,
    model             TEXT NOT NULL,
    adapter           TEXT,
    prompt_tokens     INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cached_tokens     INTEGER NOT NULL,
    finish_reasons    TEXT NOT NULL,        -- JSON list, one per choice
    outcome           TEXT NOT NULL,
    end_user          TEXT,                 -- the request's `user`
    safety_identifier TEXT,
    metadata          TEXT NOT NULL,        -- JSON object
    UNIQUE (tenant_id, request_id)
);
CREATE INDEX IF NOT EXISTS request_records_by_time ON request_records (tenant_id, created_at);
CREATE INDEX IF NOT EXISTS request_records_by_user ON request_records (tenant_id, end_user, created_at)
    WHERE end_user IS NOT NULL;
"""


def prepare_database(conn: sqlite3.Connection) -> None:
    """Switch the file to WAL mode and create missing tables (safe when processes race to do it)."""
    mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if mode.lower() != "wal":
        raise RuntimeError(f"SQLite refused WAL mode (journal_mode is {mode!r}); is the file on a network share?")
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(
                f"store schema version {version} is newer than this code understands ({SCHEMA_VERSION})"
            )
        for statement in SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
