"""Store contract, tenants and API keys: runs against SQLite (a file in tmp_path) and a real Redis."""

from __future__ import annotations

import hashlib
import threading

import pytest
import redis

from gateway.store import (
    AlreadyExistsError,
    NotFoundError,
    Store,
    TenantSuspendedError,
    open_store,
)

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
    a = store.create_tenant("acme", policy={"rpm": 60}, now=T0)
    b = store.create_tenant("globex", shared=True, now=T0 + 1)
    assert a.id != b.id and a.created_at == T0 and not a.suspended and not a.shared and b.shared
    assert a.policy == {"rpm": 60} and b.policy == {}
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
    with pytest.raises(ValueError, match="policy must be a JSON object"):
        store.create_tenant("p1", policy=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not JSON-serializable"):
        store.create_tenant("p2", policy={"x": object()})
    assert [t.name for t in store.list_tenants()] == ["acme"]


def test_update_policy_returns_before_and_after(store: Store) -> None:
    t = store.create_tenant("acme", policy={"rpm": 60})
    before, after = store.update_policy(t.id, {"rpm": 120, "tpm": {"limit": 1000}})
    assert before == {"rpm": 60} and after == {"rpm": 120, "tpm": {"limit": 1000}}
    fetched = store.get_tenant(t.id)
    assert fetched is not None and fetched.policy == after and fetched.cache_salt == t.cache_salt
    fetched.policy["rpm"] = 1  # a returned dict is a copy
    assert store.get_tenant(t.id).policy["rpm"] == 120  # type: ignore[union-attr]
    with pytest.raises(NotFoundError, match="ten_missing"):
        store.update_policy("ten_missing", {})


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
    t = store.create_tenant("acme", policy={"rpm": 5}, now=T0)
    plaintext, key = store.create_api_key(t.id, expires_at=T0 + 1000, now=T0)
    store.suspend_tenant(t.id)
    store.close()
    with open_store(store_url) as again:
        reopened = again.get_tenant(t.id)
        assert reopened is not None and reopened.suspended and reopened.name == "acme"
        again.resume_tenant(t.id)
        found = again.authenticate(plaintext, now=T0 + 1)
        assert found is not None and found.key.id == key.id and found.tenant.policy == {"rpm": 5}
        assert found.tenant.cache_salt == t.cache_salt and found.key.expires_at == T0 + 1000
