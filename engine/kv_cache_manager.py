"""Blocks per request: allocation for new tokens, release, and prefix-cache reuse when enabled."""

from __future__ import annotations

from engine.block_pool import BlockPool
from engine.radix_cache import RadixCache
from engine.request import Request
from wire.protocol import PrefixNamespace, prefix_namespace


class KVCacheManager:
    """Owns the block pool and (optionally) the radix prefix cache; holds no tensors.

    A request's `block_ids` cover positions 0 .. len(block_ids) * block_size - 1. Each block id in it
    holds one reference for the request; blocks held by the radix cache hold one more for the tree.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.prefix_cache = RadixCache(self.pool, block_size) if enable_prefix_caching else None

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        """Share of blocks in use by requests, 0..1. Blocks only the prefix cache holds count as free (as
        vLLM's kv_cache_usage_perc does): an allocation evicts them, so a busy cache does not read as full."""
        evictable = self.prefix_cache.num_evictable_blocks if self.prefix_cache is not None else 0
        return 1.0 - (self.pool.num_free_blocks + evictable) / self.pool.num_blocks

    def match_prefix(self, req: Request) -> int:
        """On admission: reuse cached whole blocks of the prompt. Returns the number of cached tokens.

        Only whole blocks are reused and the last token of the sequence is always recomputed, so the
        runner has logits to sample from. Mutates req.block_ids (taking a reference on each block) and
        locks the matched path in the tree until `free(req)`.
        """
        if self.prefix_cache is None or req.block_ids:
            return 0
        tokens = req.all_token_ids
        limit = (len(tokens) - 1) // self.block_size * self.block_size
        blocks = self.prefix_cache.match_and_lock(req.request_id, _namespace(req), tokens[:limit])
        self.pool.incref(blocks)
        req.block_ids = list(blocks)
        return len(blocks) * self.block_size

    def prefix_pending_in(self, req: Request, running: list[Request]) -> bool:
        """Whether a request in `running` (same namespace) is still to compute a whole prompt block that
        req's prompt shares with it, tokens before it included, and that req could reuse: admitted once
        that block is in the tree, req computes only what is its own. Looks at the tree not at all (no
        lock, no hit counting), so a request that waits many steps costs a few list compares a step."""
        if self.prefix_cache is None:
            return False
        bs, tokens = self.block_size, req.all_token_ids
        limit = (len(tokens) - 1) // bs * bs  # what match_prefix could reuse: whole blocks, never the last token
        namespace = None
        for other in running:
            prompt = other.prompt_token_ids
            nxt = other.num_computed_tokens // bs * bs + bs  # end of the first block other has not finished
            if nxt > min(limit, len(prompt)) or prompt[nxt - bs : nxt] != tokens[nxt - bs : nxt]:
                continue
            namespace = namespace or _namespace(req)
            if _namespace(other) == namespace and prompt[: nxt - bs] == tokens[: nxt - bs]:
                return True
        return False

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        total = req.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(req.block_ids))

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Make sure req has blocks for num_new_tokens more tokens; evict cached blocks if needed.

        Returns False, changing nothing for req, when the pool cannot provide them.
        """
        need = self.blocks_needed(req, num_new_tokens)
        if need == 0:
            return True
        short = need - self.pool.num_free_blocks
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)
        if not self.pool.can_allocate(need):
            return False
        req.block_ids.extend(self.pool.allocate(need))
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """Insert req's computed whole blocks into the prefix cache (after a prefill chunk or at finish).

        Blocks the tree already held for the same tokens replace req's duplicates in req.block_ids,
        and the duplicates go back to the pool.
        """
        if self.prefix_cache is None:
            return
        n_full = req.num_computed_tokens // self.block_size
        if n_full == 0:
            return
        tokens = req.all_token_ids[: n_full * self.block_size]
        canonical = self.prefix_cache.insert(req.request_id, _namespace(req), tokens, req.block_ids[:n_full])
        for i, (mine, kept) in enumerate(zip(req.block_ids[:n_full], canonical, strict=True)):
            if mine != kept:
                self.pool.incref([kept])
                self.pool.free([mine])
                req.block_ids[i] = kept

    def free(self, req: Request) -> None:
        """Release everything req holds: its block references and its lock on the tree."""
        if self.prefix_cache is not None:
            self.prefix_cache.unlock(req.request_id)
        self.pool.free(req.block_ids)
        req.block_ids = []

    def check_integrity(self, live_requests: list[Request]) -> None:
        """Every block is free, held by a live request, or held by the tree — with exact counts."""
        expected = [0] * self.pool.num_blocks
        for req in live_requests:
            for b in req.block_ids:
                expected[b] += 1
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
            for b in self.prefix_cache.held_blocks():
                expected[b] += 1
        if expected != self.pool.ref_counts:
            bad = [b for b in range(self.pool.num_blocks) if expected[b] != self.pool.ref_counts[b]]
            raise AssertionError(f"block reference counts disagree with holders for blocks {bad[:10]}")
        self.pool.check_integrity()


def _namespace(req: Request) -> PrefixNamespace:
    """Prefix-cache namespace: the request's cache salt and its adapter's content (wire/protocol.py)."""
    return prefix_namespace(req.cache_salt, req.adapter.sha256 if req.adapter else None)
