"""Radix tree over KV block pages: shared prefixes are computed once (SGLang RadixAttention style).

Keys are pages of `block_size` token ids under a namespace (tenant cache salt, adapter identity), so
two tenants or two adapters never share KV, and an adapter re-uploaded under the same name (new content
hash) never sees its old KV. Plain Python over ints: no tensors, testable without a model.

Each block the tree holds carries one reference in the BlockPool for the tree. A request that matched or
inserted a path *locks* it (lock_ref on every node up to the root); locked nodes are never evicted.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from engine.block_pool import BlockPool

Page = tuple[int, ...]
Namespace = tuple[str, str]


@dataclass(eq=False)
class _Node:
    pages: list[Page]  # token pages on the edge from parent to this node
    blocks: list[int]  # one KV block per page
    parent: _Node | None
    children: dict[Page, _Node] = field(default_factory=dict)  # keyed by the child's first page
    lock_ref: int = 0
    last_access: int = 0


@dataclass
class RadixCacheStats:
    query_tokens: int = 0  # prompt tokens looked up in match_and_lock
    hit_tokens: int = 0  # of which served from the tree
    evicted_blocks: int = 0
    inserted_blocks: int = 0


class RadixCache:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.stats = RadixCacheStats()
        self._roots: dict[Namespace, _Node] = {}
        self._locked: dict[str, _Node] = {}  # request id -> deepest node it locks
        self._clock = itertools.count(1)
        self._num_blocks = 0
        self._locked_blocks = 0  # blocks in nodes some request locks; the rest can be evicted

    @property
    def num_blocks(self) -> int:
        """Blocks held by the tree."""
        return self._num_blocks

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks only the tree holds (no request locks their node): free for the asking."""
        return self._num_blocks - self._locked_blocks

    # ----- lookup -----------------------------------------------------------------------------------

    def match_and_lock(self, req_id: str, namespace: Namespace, tokens: list[int]) -> list[int]:
        """Longest cached prefix of `tokens` (whole pages only) in `namespace`; locks it for req_id.

        Returns the block ids of the matched pages (the caller takes its own references on them).
        Splits a node when the match ends inside it. Updates LRU times and the hit counters.
        """
        pages = self._pages(tokens)
        self.stats.query_tokens += len(tokens)
        node, blocks = self._walk(namespace, pages, create_root=False)
        self.stats.hit_tokens += len(blocks) * self.block_size
        if blocks:
            assert node is not None
            self._relock(req_id, node)
        return blocks

    def _walk(self, namespace: Namespace, pages: list[Page], create_root: bool) -> tuple[_Node | None, list[int]]:
        root = self._roots.get(namespace)
        if root is None:
            if not create_root:
                return None, []
            root = self._roots[namespace] = _Node(pages=[], blocks=[], parent=None)
        node, blocks, i = root, [], 0
        now = next(self._clock)
        node.last_access = now
        while i < len(pages):
            child = node.children.get(pages[i])
            if child is None:
                break
            j = 0
            while j < len(child.pages) and i + j < len(pages) and child.pages[j] == pages[i + j]:
                j += 1
            if j < len(child.pages):
                child = self._split(child, j)
            blocks.extend(child.blocks)
            child.last_access = now
            node, i = child, i + j
        return node, blocks

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut node after `at` pages; returns the new upper node (same locks, same access time)."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.pages)
        upper = _Node(node.pages[:at], node.blocks[:at], parent, lock_ref=node.lock_ref,
                      last_access=node.last_access)
        parent.children[upper.pages[0]] = upper
        node.pages, node.blocks, node.parent = node.pages[at:], node.blocks[at:], upper
        upper.children[node.pages[0]] = node
        return upper

    # ----- insert -----------------------------------------------------------------------------------

    def insert(self, req_id: str, namespace: Namespace, tokens: list[int], blocks: list[int]) -> list[int]:
        """Add the pages of `tokens` (held in `blocks`) to the tree and move req_id's lock to its end.

        Returns the canonical block per page: the tree's own where the page was already cached (the
        caller should drop its duplicate), else the caller's block, on which the tree takes a reference.
        """
        pages = self._pages(tokens)
        assert len(pages) == len(blocks), "one block per full page"
        node, canonical = self._walk(namespace, pages, create_root=True)
        assert node is not None
        done = len(canonical)
        if done < len(pages):
            new = _Node(pages[done:], list(blocks[done:]), node, last_access=next(self._clock))
            node.children[new.pages[0]] = new
            self.pool.incref(new.blocks)
            self._num_blocks += len(new.blocks)
            self.stats.inserted_blocks += len(new.blocks)
            canonical = canonical + new.blocks
            node = new
        self._relock(req_id, node)
        return canonical

    # ----- locks ------------------------------------------------------------------------------------

    def _relock(self, req_id: str, node: _Node) -> None:
        self._add_lock(node, +1)
        self.unlock(req_id)
        self._locked[req_id] = node

    def unlock(self, req_id: str) -> None:
        """Release req_id's lock (no-op if it holds none)."""
        node = self._locked.pop(req_id, None)
        if node is not None:
            self._add_lock(node, -1)

    def _add_lock(self, node: _Node | None, delta: int) -> None:
        while node is not None:
            was_locked = node.lock_ref > 0
            node.lock_ref += delta
            if was_locked != (node.lock_ref > 0):
                self._locked_blocks += len(node.blocks) if node.lock_ref > 0 else -len(node.blocks)
            node = node.parent

    # ----- eviction ---------------------------------------------------------------------------------

    def evict(self, num_blocks: int) -> int:
        """Free at least num_blocks blocks (if possible) from unlocked leaves, least recently used first.

        Whole nodes are evicted; a parent that becomes an unlocked leaf joins the candidates. Returns the
        number of blocks freed back to the pool (the tree's references dropped).
        """
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_blocks:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[node.pages[0]]
            self.pool.free(node.blocks)
            freed += len(node.blocks)
            self._num_blocks -= len(node.blocks)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
            elif parent.parent is None and not parent.children:
                self._roots = {ns: r for ns, r in self._roots.items() if r is not parent}
        self.stats.evicted_blocks += freed
        return freed

    def flush(self) -> int:
        """Evict everything unlocked. Returns blocks freed."""
        return self.evict(self._num_blocks)

    def _leaves(self) -> list[_Node]:
        out, stack = [], [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out

    # ----- introspection ----------------------------------------------------------------------------

    def _pages(self, tokens: list[int]) -> list[Page]:
        bs = self.block_size
        return [tuple(tokens[i : i + bs]) for i in range(0, len(tokens) - len(tokens) % bs, bs)]

    def held_blocks(self) -> list[int]:
        out = []
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                out.extend(node.blocks)
                stack.extend(node.children.values())
        return out

    def check_integrity(self) -> None:
        """Tree shape, lock counts and block bookkeeping are consistent. Does not modify the cache."""
        expected_locks: dict[int, int] = {}
        for node in self._locked.values():
            n: _Node | None = node
            while n is not None:
                expected_locks[id(n)] = expected_locks.get(id(n), 0) + 1
                n = n.parent
        seen: set[int] = set()
        locked_blocks = 0
        for root in self._roots.values():
            stack = [root]
            while stack:
                node = stack.pop()
                if node.lock_ref != expected_locks.get(id(node), 0):
                    raise AssertionError("lock_ref disagrees with the requests holding locks")
                if node.parent is not None:
                    if not node.pages or len(node.pages) != len(node.blocks):
                        raise AssertionError("node pages and blocks disagree")
                    if node.parent.children.get(node.pages[0]) is not node:
                        raise AssertionError("child is not keyed by its first page")
                    if any(len(p) != self.block_size for p in node.pages):
                        raise AssertionError("partial page in the tree")
                if node.lock_ref > 0:
                    locked_blocks += len(node.blocks)
                for b in node.blocks:
                    if b in seen:
                        raise AssertionError(f"block {b} appears twice in the tree")
                    if self.pool.ref_counts[b] < 1:
                        raise AssertionError(f"tree holds free block {b}")
                    seen.add(b)
                for child in node.children.values():
                    if child.parent is not node:
                        raise AssertionError("broken parent link")
                    stack.append(child)
        if len(seen) != self._num_blocks:
            raise AssertionError("block count of the tree is stale")
        if locked_blocks != self._locked_blocks:
            raise AssertionError("locked-block count of the tree is stale")
