"""open_store: which backend a URL or path opens, and the errors for the ones it cannot."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from gateway.store import RedisOptions, RedisStore, SqliteStore, open_store


def test_paths_and_sqlite_urls_open_sqlite(tmp_path: Path) -> None:
    for target in (str(tmp_path / "a.db"), tmp_path / "b.db", f"sqlite://{tmp_path / 'c.db'}"):
        with open_store(target) as store:
            assert isinstance(store, SqliteStore)
            store.create_tenant("acme")
    assert {p.name for p in tmp_path.glob("*.db")} == {"a.db", "b.db", "c.db"}


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("", "path or URL"),
        (":memory:", "not supported"),
        ("sqlite://relative.db", "absolute path"),
        ("postgres://db/x", "unknown store URL scheme"),
    ],
)
def test_unusable_targets_are_refused(target: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        open_store(target)


@pytest.mark.redis
def test_redis_url_opens_redis_and_prefixes_isolate(redis_server) -> None:
    with open_store(redis_server.url) as plain, \
            open_store(redis_server.url, redis=RedisOptions(key_prefix="staging:")) as staging:
        assert isinstance(plain, RedisStore)
        plain.create_tenant("acme")
        staging.create_tenant("acme")  # same name, other namespace
        assert len(plain.list_tenants()) == 1 and len(staging.list_tenants()) == 1
    with pytest.raises(ValueError, match="prefix"):
        RedisOptions(key_prefix="has space")


@pytest.mark.redis
def test_ping_fails_when_redis_is_gone(redis_server) -> None:
    with open_store(redis_server.url, redis=RedisOptions(socket_timeout_s=1.0)) as store:
        store.ping()
        redis_server.stop()
        with pytest.raises(redis.ConnectionError):
            store.ping()
