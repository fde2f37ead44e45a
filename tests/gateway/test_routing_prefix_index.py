"""The gateway's approximate prefix index: chained page hashes per namespace, LRU bound, expiry."""

from __future__ import annotations

import pytest

from gateway.workers.prefix_index import PrefixIndex, PrefixIndexConfig, page_hashes


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_page_hashes_chain_over_full_pages_only():
    a = page_hashes("ns", tokens(10), 4)
    assert len(a) == 2  # the last 2 tokens are no full page
    b = page_hashes("ns", tokens(8) + [99, 98, 97, 96], 4)
    assert b[:2] == a and len(b) == 3
    assert page_hashes("ns", [0, 1, 2, 3, 9, 9, 9, 9], 4)[0] == a[0]
    assert page_hashes("ns", [9, 9, 9, 9, 4, 5, 6, 7], 4)[1] != a[1]  # same page, other prefix: other hash
    assert page_hashes("other", tokens(8), 4) != a[:2]


def test_match_is_the_longest_indexed_prefix_per_worker_within_a_namespace():
    index = PrefixIndex(PrefixIndexConfig(page_size=4))
    index.insert("w1", "tenant-a", tokens(12))
    index.insert("w2", "tenant-a", tokens(6))
    assert index.match("tenant-a", tokens(12) + [500]) == {"w1": 12, "w2": 4}
    assert index.match("tenant-a", tokens(4) + [7, 7, 7, 7]) == {"w1": 4, "w2": 4}
    assert index.match("tenant-b", tokens(12)) == {}  # tenants never match each other
    assert index.match("tenant-a", [1] + tokens(11)) == {}


def test_entries_expire_and_the_index_is_bounded_in_lru_order():
    clock = Clock()
    index = PrefixIndex(PrefixIndexConfig(page_size=2, max_pages=4, ttl_s=10.0), clock=clock)
    index.insert("w1", "ns", tokens(4))  # pages A, AB
    clock.now = 5.0
    index.insert("w1", "ns", tokens(4, start=100))  # pages C, CD
    assert len(index) == 4
    index.insert("w2", "ns", tokens(2))  # touches A: LRU order is now AB, C, CD, A
    index.insert("w2", "ns", tokens(2, start=200))  # a fifth page: AB goes
    assert len(index) == 4
    assert index.match("ns", tokens(4)) == {"w1": 2, "w2": 2}
    clock.now = 12.0  # w1's entries from t=0 have expired; w2's A (t=5) has not
    assert index.match("ns", tokens(4)) == {"w2": 2}
    assert index.match("ns", tokens(4, start=100)) == {"w1": 4}


def test_remove_worker_forgets_only_that_worker():
    index = PrefixIndex(PrefixIndexConfig(page_size=4))
    index.insert("w1", "ns", tokens(8))
    index.insert("w2", "ns", tokens(4))
    index.remove_worker("w1")
    assert index.match("ns", tokens(8)) == {"w2": 4}
    assert len(index) == 1


@pytest.mark.parametrize("field,value", [("page_size", 0), ("max_pages", 0), ("ttl_s", 0.0)])
def test_config_rejects_nonsense(field, value):
    with pytest.raises(ValueError, match=field):
        PrefixIndexConfig(**{field: value})
