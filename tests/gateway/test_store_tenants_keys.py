"""Store contract, tenants and API keys: runs against SQLite (a file in tmp_path) and a real Redis."""

from __future__ import annotations

import hashlib
import threading

import pytest
import redis

from gateway.store import (
    AlreadyExistsError,
    NotFoundError,
    RedisStore,
    Store,
    TenantSuspendedError,
    open_store,
)
from policies import InvalidPolicy, TenantPolicy

T0 = 1_700_000_000.0


def stored_bytes(store_url: str) -> bytes:
    """Everything the backend holds, as raw bytes (to prove what is never stored)."""
    if store_url.startswith("sqlite://"):
        from pathlib import Path

        db = Path(store_url[len("sqlite://"):])
        return b"".join(p.read_bytes() for p in db.parent.iterdir())
    client = redis.Redis.from_url(store_url)
    try:
        return b"".join(client.dump(k) or b"" for k in client.scan_iter())
    finally:
        client.close()


def test_create_and_look_up_tenants(store: Store) -> None:
    a = store.create_tenant("acme", policy={"requests_per_minute": 60}, now=T0)
    b = store.create_tenant("globex", shared=True, now=T0 + 1)
    assert a.id != b.id and a.created_at == T0 and not a.suspended and not a.shared and b.shared
    assert a.policy == TenantPolicy(requests_per_minute=60) and a.policy.overrides() == {"requests_per_minute": 60}
    assert b.policy == TenantPolicy() and a.policy_error is None
    assert len(a.cache_salt) == 32 and a.cache_salt != b.cache_salt
    assert store.get_tenant(a.id) == a
    assert store.get_tenant_by_name("globex") == b
    assert store.get_tenant("ten_missing") is None and store.get_tenant_by_name("nobody") is None
    assert store.list_tenants() == [a, b]


def test_tenant_names_are_unique_and_validated(store: Store) -> None:
    store.create_tenant("acme")
    with pytest.raises(AlreadyExistsError, match="acme"):
        store.create_tenant("acme")
    for bad in ("", "has space", "a@b", "x:y", "-lead", "n" * 65):
        with pytest.raises(ValueError, match="tenant name"):
            store.create_tenant(bad)
    with pytest.raises(InvalidPolicy, match="policy: must be a JSON object"):
        store.create_tenant("p1", policy=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(InvalidPolicy, match="x: unknown field"):
        store.create_tenant("p2", policy={"x": object()})
    with pytest.raises(InvalidPolicy, match="max_priority"):
        store.create_tenant("p3", policy={"min_priority": 5, "max_priority": 4})
    assert [t.name for t in store.list_tenants()] == ["acme"]


def test_update_policy_returns_before_and_after(store: Store) -> None:
    t = store.create_tenant("acme", policy={"requests_per_minute": 60})
    before, after = store.update_policy(t.id, t.policy.with_changes({"requests_per_minute": 120,
                                                                       "tokens_per_minute": 1000}))
    assert before.overrides() == {"requests_per_minute": 60}
    assert after.overrides() == {"requests_per_minute": 120, "tokens_per_minute": 1000}
    fetched = store.get_tenant(t.id)
    assert fetched is not None and fetched.policy == after and fetched.cache_salt == t.cache_salt
    assert fetched.policy.max_tokens_per_request == 1000  # an unset field follows the stored ones
    with pytest.raises(InvalidPolicy, match="requests_per_minute"):
        store.update_policy(t.id, {"requests_per_minute": 0})
    assert store.get_tenant(t.id).policy == after  # type: ignore[union-attr]
    with pytest.raises(NotFoundError, match="ten_missing"):
        store.update_policy("ten_missing", {})


def test_a_stored_policy_that_does_not_validate_reads_as_the_defaults_with_the_problem(
        store: Store, store_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Written by an older version or by hand: every reader gets the same TenantPolicy (the defaults) and
    the same one error, logged once, while the tenant stays usable and fixable."""
    t = store.create_tenant("legacy", policy={"requests_per_minute": 5})
    plaintext, _ = store.create_api_key(t.id)
    broken = '{"requests_per_minute": -5, "rpm": 60}'
    if isinstance(store, RedisStore):
        client = redis.Redis.from_url(store_url)
        client.hset(store.keys.tenant(t.id), "policy", broken)
        client.close()
    else:
        import sqlite3

        with sqlite3.connect(store_url[len("sqlite://"):]) as db:
            db.execute("UPDATE tenants SET policy = ? WHERE id = ?", (broken, t.id))
    with caplog.at_level("ERROR", logger="gateway.store.stored_policy"):
        fetched = store.get_tenant(t.id)
        found = store.authenticate(plaintext)
        listed = [x for x in store.list_tenants() if x.id == t.id]
    assert fetched is not None and found is not None
    for tenant in (fetched, found.tenant, *listed):
        assert tenant.policy == TenantPolicy() and "requests_per_minute" in (tenant.policy_error or "")
    assert len([r for r in caplog.records if t.id in r.getMessage()]) == 1
    before, after = store.update_policy(t.id, {"requests_per_minute": 7})
    assert before == TenantPolicy() and store.get_tenant(t.id).policy_error is None  # type: ignore[union-attr]


def test_suspend_resume_and_shared_flag(store: Store) -> None:
    t = store.create_tenant("acme")
    assert store.suspend_tenant(t.id).suspended
    assert store.get_tenant(t.id).suspended  # type: ignore[union-attr]
    assert not store.resume_tenant(t.id).suspended
    assert store.set_tenant_shared(t.id, True).shared
    with pytest.raises(NotFoundError):
        store.suspend_tenant("ten_missing")


def test_api_key_is_stored_only_as_a_hash(store: Store, store_url: str) -> None:
    t = store.create_tenant("acme")
    plaintext, key = store.create_api_key(t.id, name="ci", now=T0)
    assert plaintext.startswith("lpx-") and len(plaintext) >= 4 + 43
    assert key.prefix == plaintext[:12] and key.hash == hashlib.sha256(plaintext.encode()).hexdigest()
    assert key.scopes == frozenset({"tenant"}) and key.tenant_id == t.id and key.name == "ci"
    assert store.get_api_key(key.id) == key
    assert plaintext.encode() not in stored_bytes(store_url)
    assert plaintext[4:].encode() not in stored_bytes(store_url)
    other, _ = store.create_api_key(t.id)
    assert other != plaintext


def test_authenticate_valid_unknown_and_garbage(store: Store) -> None:
    t = store.create_tenant("acme")
    plaintext, key = store.create_api_key(t.id, scopes={"tenant", "admin"}, now=T0)
    found = store.authenticate(plaintext, now=T0 + 5)
    assert found is not None
    assert found.key.id == key.id and found.tenant == t and found.key.scopes == {"tenant", "admin"}
    got_key, got_tenant = found  # a plain tuple too
    assert got_tenant.id == t.id and got_key.last_used_at == T0 + 5
    assert store.get_api_key(key.id).last_used_at == T0 + 5  # type: ignore[union-attr]
    assert store.authenticate("lpx-" + "A" * 43, now=T0) is None
    assert store.authenticate(plaintext + "x", now=T0) is None
    for garbage in ("", "Bearer x", plaintext[4:], "lpx-", "lpx-" + "a" * 500):
        assert store.authenticate(garbage, now=T0) is None


def test_last_used_is_written_at_most_once_a_minute(store: Store) -> None:
    t = store.create_tenant("acme")
    plaintext, key = store.create_api_key(t.id, now=T0)
    store.authenticate(plaintext, now=T0 + 1)
    store.authenticate(plaintext, now=T0 + 30)
    assert store.get_api_key(key.id).last_used_at == T0 + 1  # type: ignore[union-attr]
    store.authenticate(plaintext, now=T0 + 62)
    assert store.get_api_key(key.id).last_used_at == T0 + 62  # type: ignore[union-attr]


def test_revoked_and_expired_keys_do_not_authenticate(store: Store) -> None:
    t = store.create_tenant("acme")
    revoked, rkey = store.create_api_key(t.id, now=T0)
    expiring, _ = store.create_api_key(t.id, expires_at=T0 + 100, now=T0)
    assert store.authenticate(revoked, now=T0 + 1) is not None
    first = store.revoke_api_key(rkey.id, now=T0 + 2)
    assert first.revoked_at == T0 + 2
    assert store.revoke_api_key(rkey.id, now=T0 + 9).revoked_at == T0 + 2  # first revocation wins
    assert store.authenticate(revoked, now=T0 + 3) is None
    assert store.authenticate(expiring, now=T0 + 99.9) is not None
    assert store.authenticate(expiring, now=T0 + 100) is None
    with pytest.raises(NotFoundError, match="key_missing"):
        store.revoke_api_key("key_missing")


def test_suspended_tenant_is_a_distinct_outcome(store: Store) -> None:
    t = store.create_tenant("acme")
    plaintext, key = store.create_api_key(t.id, now=T0)
    store.suspend_tenant(t.id)
    with pytest.raises(TenantSuspendedError) as info:
        store.authenticate(plaintext, now=T0 + 1)
    assert info.value.tenant.id == t.id and info.value.key.id == key.id
    store.revoke_api_key(key.id, now=T0 + 2)
    assert store.authenticate(plaintext, now=T0 + 3) is None  # a revoked key is just unknown (401)
    other, _ = store.create_api_key(t.id, now=T0)
    store.resume_tenant(t.id)
    assert store.authenticate(other, now=T0 + 4) is not None


def test_key_arguments_are_validated(store: Store) -> None:
    t = store.create_tenant("acme")
    with pytest.raises(NotFoundError, match="tenant"):
        store.create_api_key("ten_missing")
    with pytest.raises(ValueError, match="at least one scope"):
        store.create_api_key(t.id, scopes=set())
    with pytest.raises(ValueError, match="scope 'Bad Scope'"):
        store.create_api_key(t.id, scopes={"Bad Scope"})
    with pytest.raises(ValueError, match="not the string"):
        store.create_api_key(t.id, scopes="admin")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expires_at"):
        store.create_api_key(t.id, expires_at=float("inf"))
    assert store.list_api_keys(t.id) == []


def test_list_keys_per_tenant_and_all(store: Store) -> None:
    a, b = store.create_tenant("acme"), store.create_tenant("globex")
    _, k1 = store.create_api_key(a.id, now=T0)
    _, k2 = store.create_api_key(b.id, now=T0 + 1)
    _, k3 = store.create_api_key(a.id, now=T0 + 2)
    store.revoke_api_key(k3.id, now=T0 + 3)
    assert [k.id for k in store.list_api_keys(a.id)] == [k1.id, k3.id]
    assert [k.id for k in store.list_api_keys()] == [k1.id, k2.id, k3.id]
    assert store.list_api_keys("ten_missing") == []


def test_concurrent_authentication_from_threads(store: Store) -> None:
    t = store.create_tenant("acme")
    keys = [store.create_api_key(t.id, now=T0)[0] for _ in range(4)]
    failures: list[object] = []

    def worker(i: int) -> None:
        for n in range(25):
            if store.authenticate(keys[(i + n) % 4], now=T0 + n * 61) is None:
                failures.append((i, n))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert failures == []


def test_tenants_and_keys_survive_reopen(store: Store, store_url: str) -> None:
    t = store.create_tenant("acme", policy={"requests_per_minute": 5}, now=T0)
    plaintext, key = store.create_api_key(t.id, expires_at=T0 + 1000, now=T0)
    store.suspend_tenant(t.id)
    store.close()
    with open_store(store_url) as again:
        reopened = again.get_tenant(t.id)
        assert reopened is not None and reopened.suspended and reopened.name == "acme"
        again.resume_tenant(t.id)
        found = again.authenticate(plaintext, now=T0 + 1)
        assert found is not None and found.key.id == key.id and found.tenant.policy.overrides() == {"requests_per_minute": 5}
        assert found.tenant.cache_salt == t.cache_salt and found.key.expires_at == T0 + 1000
