"""Durable budget counters for the in-memory quota backend (the persistence hook).

A UsageLedger stores, per (tenant, period key), the tokens booked so far ("d:2025-01-31", "m:2025-01").
MemoryQuotaBackend makes every change of a budgeted tenant durable before it answers (a reservation at
admission, the refund or surcharge at reconcile), group-committed through policies.ledger_writer, and reads a
counter back the first time it needs it after a restart, so a restart loses nothing that was counted. The
gateway's store may implement the protocol itself (three methods; `add_many` makes a batch one
transaction); SqliteUsageLedger is the embedded default.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol


class UsageLedger(Protocol):
    def tokens(self, tenant_id: str, period: str) -> int:
        """Tokens booked for tenant in period (0 if none). Does not modify the ledger."""
        ...

    def add(self, tenant_id: str, period: str, delta: int) -> None:
        """Durably add `delta` (may be negative) before returning."""
        ...

    def add_many(self, deltas: Mapping[tuple[str, str], int]) -> None:
        """Durably add every (tenant id, period) delta in one transaction: all of them or none."""
        ...


class SqliteUsageLedger:
    """UsageLedger in one SQLite file (WAL, synchronous=FULL: a returned add or add_many is fsynced).

    Thread-safe: reads and writes use separate connections (WAL readers never wait for the writer's fsync),
    each used by one thread at a time.
    """

    def __init__(self, path: str | Path) -> None:
        self._path = Path(path)
        self._path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # NOTE: owner-only before SQLite opens it (its -wal and -shm files take the database file's mode)
        os.close(os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600))
        os.chmod(self._path, 0o600)
        self._writer = self._connect()
        self._writer.execute("PRAGMA journal_mode=WAL")
        self._writer.execute(
            "CREATE TABLE IF NOT EXISTS token_usage ("
            " tenant_id TEXT NOT NULL, period TEXT NOT NULL, tokens INTEGER NOT NULL,"
            " PRIMARY KEY (tenant_id, period))"
        )
        self._reader = self._connect()
        self._write_lock = threading.Lock()
        self._read_lock = threading.Lock()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA synchronous=FULL")
        return db

    def tokens(self, tenant_id: str, period: str) -> int:
        with self._read_lock:
            row = self._reader.execute(
                "SELECT tokens FROM token_usage WHERE tenant_id = ? AND period = ?", (tenant_id, period)
            ).fetchone()
        return 0 if row is None else int(row[0])

    def add(self, tenant_id: str, period: str, delta: int) -> None:
        self.add_many({(tenant_id, period): delta})

    def add_many(self, deltas: Mapping[tuple[str, str], int]) -> None:
        """Every delta in one committed transaction (one fsync): all of them or none."""
        rows = [(tenant_id, period, int(delta)) for (tenant_id, period), delta in deltas.items()]
        with self._write_lock:
            self._writer.execute("BEGIN IMMEDIATE")
            try:
                self._writer.executemany(
                    "INSERT INTO token_usage (tenant_id, period, tokens) VALUES (?, ?, ?) "
                    "ON CONFLICT (tenant_id, period) DO UPDATE SET tokens = tokens + excluded.tokens",
                    rows,
                )
            except BaseException:
                self._writer.execute("ROLLBACK")
                raise
            self._writer.execute("COMMIT")

    def close(self) -> None:
        with self._write_lock, self._read_lock:
            self._writer.close()
            self._reader.close()
