"""Durable budget counters for the in-memory quota backend (the persistence hook).

A UsageLedger stores, per (tenant, period key), the tokens booked so far ("d:2025-01-31", "m:2025-01").
MemoryQuotaBackend writes every change through before it answers (a reservation at admission, the
refund or surcharge at reconcile) and reads a counter back the first time it needs it after a restart, so a
restart loses nothing that was counted. The gateway's store may implement the protocol itself (two
methods); SqliteUsageLedger is the embedded default.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Protocol


class UsageLedger(Protocol):
    def tokens(self, tenant_id: str, period: str) -> int:
        """Tokens booked for tenant in period (0 if none). Does not modify the ledger."""
        ...

    def add(self, tenant_id: str, period: str, delta: int) -> None:
        """Durably add `delta` (may be negative) before returning."""
        ...


class SqliteUsageLedger:
    """UsageLedger in one SQLite file (WAL; each add is its own committed transaction)."""

    def __init__(self, path: str | Path) -> None:
        self._path = Path(path)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS token_usage ("
            " tenant_id TEXT NOT NULL, period TEXT NOT NULL, tokens INTEGER NOT NULL,"
            " PRIMARY KEY (tenant_id, period))"
        )

    def tokens(self, tenant_id: str, period: str) -> int:
        row = self._db.execute(
            "SELECT tokens FROM token_usage WHERE tenant_id = ? AND period = ?", (tenant_id, period)
        ).fetchone()
        return 0 if row is None else int(row[0])

    def add(self, tenant_id: str, period: str, delta: int) -> None:
        self._db.execute(
            "INSERT INTO token_usage (tenant_id, period, tokens) VALUES (?, ?, ?) "
            "ON CONFLICT (tenant_id, period) DO UPDATE SET tokens = tokens + excluded.tokens",
            (tenant_id, period, int(delta)),
        )

    def close(self) -> None:
        self._db.close()
