"""A pool of SQLite connections to one WAL-mode file, and the transaction discipline around them.

Each thread borrows its own connection, so readers never block each other (WAL lets reads run beside
one writer). Writes open `BEGIN IMMEDIATE`, which takes the file's write lock up front: two writers —
threads or processes — serialize there (waiting up to the busy timeout) instead of deadlocking on a
read-to-write upgrade later in the transaction.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SYNCHRONOUS_MODES = ("OFF", "NORMAL", "FULL", "EXTRA")


@dataclass(frozen=True)
class SqliteOptions:
    busy_timeout_s: float = 10.0  # how long a writer waits for another writer (thread or process)
    # NORMAL in WAL mode: a commit survives a crash of the process; only an OS crash or power cut may
    # lose the last commits. FULL fsyncs every commit.
    synchronous: str = "NORMAL"

    def __post_init__(self) -> None:
        if not self.busy_timeout_s > 0:
            raise ValueError(f"busy_timeout_s must be positive, got {self.busy_timeout_s!r}")
        if self.synchronous not in SYNCHRONOUS_MODES:
            raise ValueError(f"synchronous must be one of {SYNCHRONOUS_MODES}, got {self.synchronous!r}")


class SqliteConnections:
    """Connections to `path`, created on demand, one per concurrently active thread."""

    def __init__(self, path: Path, options: SqliteOptions) -> None:
        self.path = path
        self.options = options
        self._idle: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: autocommit; transactions are opened explicitly below.
        # check_same_thread=False: a pooled connection moves between threads, used by one at a time.
        conn = sqlite3.connect(
            self.path, timeout=self.options.busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout = {int(self.options.busy_timeout_s * 1000)}")
        conn.execute(f"PRAGMA synchronous = {self.options.synchronous}")
        conn.execute("PRAGMA foreign_keys = ON")
        return conn

    @contextmanager
    def borrow(self) -> Iterator[sqlite3.Connection]:
        """A connection for this thread's exclusive use until the block ends (autocommit mode)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"store {self.path} is closed")
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self._connect()
        try:
            yield conn
        finally:
            if conn.in_transaction:  # an error escaped mid-transaction: never pool a dirty connection
                conn.rollback()
            with self._lock:
                if self._closed:
                    conn.close()
                else:
                    self._idle.append(conn)

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: committed if the block ends normally, rolled back otherwise."""
        with self.borrow() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def close(self) -> None:
        """Close idle connections now and borrowed ones when they come back."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
