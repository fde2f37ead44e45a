"""`open_store`: pick the backend from a URL or path."""

from __future__ import annotations

from pathlib import Path

from gateway.store.base import Store
from gateway.store.redis_store import RedisOptions, RedisStore
from gateway.store.sqlite_connections import SqliteOptions
from gateway.store.sqlite_store import SqliteStore

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
SQLITE_SCHEME = "sqlite://"


def open_store(
    target: str | Path, *, sqlite: SqliteOptions | None = None, redis: RedisOptions | None = None
) -> Store:
    """Open the store named by `target`:

    - "redis://host:port/db", "rediss://..." or "unix:///path/redis.sock" → RedisStore
    - "sqlite:///abs/path/store.db" (like file:// URLs, the path after "sqlite://" is used as is, so
      three slashes mean an absolute path) or a plain filesystem path → SqliteStore
    """
    if isinstance(target, Path):
        return SqliteStore(target, sqlite)
    if not isinstance(target, str) or not target.strip():
        raise ValueError(f"store target must be a path or URL, got {target!r}")
    if target.startswith(REDIS_SCHEMES):
        return RedisStore(target, redis)
    if target.startswith(SQLITE_SCHEME):
        path = target[len(SQLITE_SCHEME):]
        if not path.startswith("/"):
            raise ValueError(f"SQLite URL {target!r} needs an absolute path: sqlite:///abs/path/store.db")
        return SqliteStore(Path(path), sqlite)
    if target == ":memory:":
        raise ValueError("':memory:' is not supported: the store shares one file between connections and processes")
    if "://" in target:
        raise ValueError(f"unknown store URL scheme in {target!r}: use sqlite:///path, redis://host:port/db or a path")
    return SqliteStore(Path(target), sqlite)
