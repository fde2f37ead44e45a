"""AuthCache and ApiKeyBackend over a real SQLite store: hits skip the store, changes are never stale."""

from __future__ import annotations

import asyncio
import time

import pytest
from starlette.authentication import AuthenticationError
from starlette.requests import HTTPConnection

from gateway.auth.backend import ApiKeyBackend, AuthCache, AuthCacheConfig
from gateway.store import SqliteStore
from gateway.store.api_keys import hash_api_key


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def store(tmp_path):
    store = SqliteStore(tmp_path / "store.db")
    yield store
    store.close()


def connection(key: str) -> HTTPConnection:
    return HTTPConnection({"type": "http", "path": "/v1/models", "headers": [(b"authorization", f"Bearer {key}".encode())],
                           "query_string": b"", "server": ("127.0.0.1", 8000), "scheme": "http"})


def test_entries_live_for_the_ttl_and_only_at_the_epoch_they_were_taken(store):
    tenant = store.create_tenant("acme")
    plaintext, _ = store.create_api_key(tenant.id)
    found = store.authenticate(plaintext)
    clock = Clock()
    cache = AuthCache(AuthCacheConfig(ttl_s=1.0), monotonic=clock)
    digest = hash_api_key(plaintext)
    cache.put(digest, found, epoch=3)
    assert cache.get(digest, 3) == found
    assert cache.get(digest, 4) is None and len(cache) == 0  # a change since: dropped
    cache.put(digest, found, epoch=3)
    clock.now += 0.999
    assert cache.get(digest, 3) == found
    clock.now += 0.002
    assert cache.get(digest, 3) is None


def test_a_key_that_expires_while_cached_is_not_served(store):
    tenant = store.create_tenant("acme")
    plaintext, _ = store.create_api_key(tenant.id, expires_at=time.time() + 60)
    found = store.authenticate(plaintext)
    cache = AuthCache(AuthCacheConfig(ttl_s=30.0), wall=lambda: time.time() + 61)
    cache.put(hash_api_key(plaintext), found, 0)
    assert cache.get(hash_api_key(plaintext), 0) is None


def test_the_cache_is_bounded_and_keeps_the_newest(store):
    tenant = store.create_tenant("acme")
    found = store.authenticate(store.create_api_key(tenant.id)[0])
    cache = AuthCache(AuthCacheConfig(ttl_s=10.0, max_entries=3))
    for i in range(5):
        cache.put(f"h{i}", found, 0)
    assert len(cache) == 3
    assert [cache.get(f"h{i}", 0) is not None for i in range(5)] == [False, False, True, True, True]
    with pytest.raises(ValueError, match="ttl_s"):
        AuthCacheConfig(ttl_s=-1)


def test_backend_answers_from_the_cache_and_sees_revocation_and_suspension_at_once(store):
    tenant = store.create_tenant("acme")
    plaintext, key = store.create_api_key(tenant.id)
    backend = ApiKeyBackend(store, AuthCache(AuthCacheConfig(ttl_s=60.0)))

    async def scenario() -> None:
        _, user = await backend.authenticate(connection(plaintext))
        assert user.tenant.id == tenant.id and len(backend.cache) == 1
        elsewhere = SqliteStore(store.path)  # another process on the same file (the CLI, a replica)
        elsewhere.revoke_api_key(key.id)
        elsewhere.close()
        _, again = await backend.authenticate(connection(plaintext))
        assert again == user  # answered from the cache: a change made elsewhere shows within the ttl
        store.revoke_api_key(key.id)  # through the gateway's own store: applies to the next request
        with pytest.raises(AuthenticationError):
            await backend.authenticate(connection(plaintext))
        other, _ = store.create_api_key(tenant.id)
        await backend.authenticate(connection(other))
        store.suspend_tenant(tenant.id)
        with pytest.raises(AuthenticationError, match="suspended"):
            await backend.authenticate(connection(other))

    asyncio.run(scenario())
