"""Store contract, adapter records: runs against SQLite (a file in tmp_path) and a real Redis."""

from __future__ import annotations

import hashlib
import threading

import pytest

from gateway.store import AdapterTotals, NotFoundError, Store, open_store

T0 = 1_700_000_000.0
MODULES = ("q_proj", "v_proj")


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def add(store: Store, tenant_id: str, name: str, content: str, size: int = 100, **kw):
    return store.add_adapter_version(
        tenant_id, name, sha(content), rank=8, target_modules=MODULES, size_bytes=size, **kw
    )


def test_versions_count_up_per_tenant_and_name(store: Store) -> None:
    a, b = store.create_tenant("acme"), store.create_tenant("globex")
    v1 = add(store, a.id, "bot", "one", description="first", now=T0)
    v2 = add(store, a.id, "bot", "two", size=200)
    other = add(store, a.id, "helper", "one")
    theirs = add(store, b.id, "bot", "three")
    assert (v1.version, v2.version, other.version, theirs.version) == (1, 2, 1, 1)
    assert v1.ref == "bot@1" and v1.target_modules == MODULES and v1.rank == 8 and v1.description == "first"
    assert v1.created_at == T0 and v1.deleted_at is None and not v1.shared
    assert store.get_adapter(a.id, "bot") == v2
    assert store.get_adapter(a.id, "bot", 1) == v1
    assert store.get_adapter(a.id, "bot", 3) is None and store.get_adapter(a.id, "nope") is None
    assert store.get_adapter(b.id, "helper") is None
    assert store.list_adapters(a.id) == [v1, v2, other]
    assert store.list_adapters(b.id) == [theirs]


def test_concurrent_uploads_get_distinct_versions(store: Store) -> None:
    t = store.create_tenant("acme")
    versions: list[int] = []
    lock = threading.Lock()

    def upload(i: int) -> None:
        for n in range(6):
            record = add(store, t.id, "bot", f"{i}-{n}")
            with lock:
                versions.append(record.version)

    threads = [threading.Thread(target=upload, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(versions) == list(range(1, 49))
    assert [r.version for r in store.list_adapters(t.id)] == list(range(1, 49))
    assert store.adapter_totals(t.id) == AdapterTotals(count=48, size_bytes=4800)


def test_soft_delete_hides_all_versions_and_numbering_continues(store: Store) -> None:
    t = store.create_tenant("acme")
    add(store, t.id, "bot", "one")
    add(store, t.id, "bot", "two")
    keep = add(store, t.id, "helper", "three")
    assert store.delete_adapter(t.id, "bot", now=T0) == 2
    assert store.delete_adapter(t.id, "bot", now=T0 + 1) == 0
    assert store.delete_adapter(t.id, "never-existed") == 0
    assert store.get_adapter(t.id, "bot") is None and store.get_adapter(t.id, "bot", 1) is None
    gone = store.get_adapter(t.id, "bot", 2, include_deleted=True)
    assert gone is not None and gone.deleted_at == T0
    assert store.get_adapter(t.id, "bot", include_deleted=True) == gone
    assert store.list_adapters(t.id) == [keep]
    assert [r.ref for r in store.list_adapters(t.id, include_deleted=True)] == ["bot@1", "bot@2", "helper@1"]
    again = add(store, t.id, "bot", "four")
    assert again.version == 3 and store.get_adapter(t.id, "bot") == again


def test_sha_references_follow_live_versions_across_tenants(store: Store) -> None:
    a, b = store.create_tenant("acme"), store.create_tenant("globex")
    add(store, a.id, "bot", "same bytes")
    add(store, a.id, "bot", "same bytes")
    add(store, b.id, "copy", "same bytes")
    assert store.is_sha_referenced(sha("same bytes")) and not store.is_sha_referenced(sha("other"))
    store.delete_adapter(a.id, "bot")
    assert store.is_sha_referenced(sha("same bytes"))  # globex still points at it
    store.delete_adapter(b.id, "copy")
    assert not store.is_sha_referenced(sha("same bytes"))
    with pytest.raises(ValueError, match="64 lowercase hex"):
        store.is_sha_referenced("ABC")


def test_shared_adapters_are_visible_to_other_tenants(store: Store) -> None:
    owner, user = store.create_tenant("owner"), store.create_tenant("user")
    public = add(store, owner.id, "public", "p", shared=True)
    private = add(store, owner.id, "private", "q")
    mine = add(store, user.id, "mine", "r")
    assert set(store.list_adapters(user.id)) == {mine, public}
    assert store.list_adapters(user.id, include_shared=False) == [mine]
    assert set(store.list_adapters(owner.id)) == {public, private}
    assert store.set_adapter_shared(owner.id, "private", True) == 1
    assert store.set_adapter_shared(owner.id, "private", True) == 0
    assert {r.ref for r in store.list_adapters(user.id)} == {"mine@1", "public@1", "private@1"}
    assert store.set_adapter_shared(owner.id, "public", False) == 1
    store.delete_adapter(owner.id, "private")
    assert store.list_adapters(user.id) == [mine]
    assert store.get_adapter(owner.id, "public").shared is False  # type: ignore[union-attr]


def test_totals_count_live_versions(store: Store) -> None:
    t = store.create_tenant("acme")
    assert store.adapter_totals(t.id) == AdapterTotals(0, 0)
    add(store, t.id, "bot", "a", size=1000)
    add(store, t.id, "bot", "b", size=2000)
    add(store, t.id, "helper", "c", size=5)
    assert store.adapter_totals(t.id) == AdapterTotals(3, 3005)
    store.delete_adapter(t.id, "bot")
    assert store.adapter_totals(t.id) == AdapterTotals(1, 5)


def test_adapter_arguments_are_validated(store: Store) -> None:
    t = store.create_tenant("acme")
    with pytest.raises(NotFoundError, match="tenant"):
        add(store, "ten_missing", "bot", "x")
    with pytest.raises(ValueError, match="adapter name"):
        add(store, t.id, "bot@2", "x")
    with pytest.raises(ValueError, match="sha256"):
        store.add_adapter_version(t.id, "bot", "f" * 63, rank=8, target_modules=MODULES, size_bytes=1)
    with pytest.raises(ValueError, match="rank"):
        store.add_adapter_version(t.id, "bot", sha("x"), rank=0, target_modules=MODULES, size_bytes=1)
    with pytest.raises(ValueError, match="target_modules"):
        store.add_adapter_version(t.id, "bot", sha("x"), rank=8, target_modules=[], size_bytes=1)
    with pytest.raises(ValueError, match="size_bytes"):
        store.add_adapter_version(t.id, "bot", sha("x"), rank=8, target_modules=MODULES, size_bytes=-1)
    assert store.list_adapters(t.id) == [] and store.adapter_totals(t.id) == AdapterTotals(0, 0)
    assert add(store, t.id, "bot", "x").version == 1  # failed calls used up no version


def test_adapters_survive_reopen(store: Store, store_url: str) -> None:
    t = store.create_tenant("acme")
    add(store, t.id, "bot", "one", size=10)
    add(store, t.id, "bot", "two", size=20, shared=True)
    store.delete_adapter(t.id, "bot")
    add(store, t.id, "bot", "three", size=30)
    before = store.list_adapters(t.id, include_deleted=True)
    store.close()
    with open_store(store_url) as again:
        assert again.list_adapters(t.id, include_deleted=True) == before
        assert again.adapter_totals(t.id) == AdapterTotals(1, 30)
        assert again.is_sha_referenced(sha("three")) and not again.is_sha_referenced(sha("one"))
        assert add(again, t.id, "bot", "four").version == 4
