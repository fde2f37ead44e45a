"""A fixed pool of KV block ids with reference counts. Plain Python over ints."""

from __future__ import annotations

from collections import OrderedDict


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """Block ids 0..num_blocks-1, each with a reference count.

    A block is free exactly when its count is 0. The free list is an ordered dict used as a doubly
    linked list: allocate pops from the front and free appends at the back, both O(1), and any block can
    leave the list in O(1). NOTE: cached prefix blocks never wait in the free list: the radix cache holds
    its own reference on them and gives them back only when it evicts them (SGLang style), so a cache hit
    takes a reference instead of fishing a block out of the free list (vLLM style).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks (count 0 -> 1). Raises NoFreeBlocksError and takes nothing if short."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def incref(self, block_ids: list[int]) -> None:
        """Add a holder to blocks that are already in use."""
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise AssertionError(f"incref of free block {b}")
            self.ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one holder from each block; blocks whose count reaches 0 return to the free list."""
        for b in block_ids:
            count = self.ref_counts[b] - 1
            if count < 0:
                raise AssertionError(f"double free of block {b}")
            self.ref_counts[b] = count
            if count == 0:
                self._free[b] = None

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def check_integrity(self) -> None:
        """Free list == blocks with count 0; counts never negative."""
        zero = {b for b, c in enumerate(self.ref_counts) if c == 0}
        if zero != set(self._free):
            raise AssertionError("free list and zero reference counts disagree")
        if any(c < 0 for c in self.ref_counts):
            raise AssertionError("negative reference count")
