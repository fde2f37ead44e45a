"""Block pool: reference counts, free-list order, all-or-nothing allocation."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool, NoFreeBlocksError


def test_allocate_takes_from_the_front_and_free_returns_to_the_back():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert a == [0, 1] and pool.num_free_blocks == 2
    pool.free([0])
    assert pool.allocate(3) == [2, 3, 0]  # the block freed last is reused last
    pool.check_integrity()


def test_shared_blocks_return_only_when_the_last_holder_frees():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.incref([b])
    pool.free([b])
    assert not pool.is_free(b)
    pool.free([b])
    assert pool.is_free(b)
    with pytest.raises(AssertionError, match="double free"):
        pool.free([b])


def test_allocation_is_all_or_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1 and pool.can_allocate(1) and not pool.can_allocate(2)
    with pytest.raises(AssertionError, match="incref of free block"):
        pool.incref([2])
    pool.check_integrity()
