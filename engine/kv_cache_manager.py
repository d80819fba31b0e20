"""Paged KV-cache bookkeeping: block pool, prefix cache, dedup, fork and copy-on-write.

The scheduler talks to `KVCacheManager` through `get_computed_blocks`, `allocate_slots`,
`cache_blocks` and `free` (plus `fork`); it never touches free lists or hashes.

Invariants (checked by tests/engine/test_kv_cache_manager*.py):
- ref_cnt[b] == number of block tables holding b; a block is in the free queue iff ref_cnt == 0.
- The hash index maps each hash to exactly one block, and that block's content hashes to it.
- Free queue order is eviction order: blocks without a hash first (nothing to lose), then cached
  blocks least recently freed first; a request frees its tail first, so tails are evicted first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from engine.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    queries_tokens: int = 0  # prompt tokens looked up on admission
    hit_tokens: int = 0  # of those, served from cache
    dedup_merges: int = 0  # full blocks merged into an identical cached block
    evictions: int = 0  # cached blocks whose hash was dropped to reuse them
    cow_copies: int = 0  # shared partial blocks copied before a write


class BlockPool:
    """Ref-counted blocks, an O(1) LRU free queue and the hash index."""

    def __init__(self, num_blocks: int, stats: PrefixCacheStats):
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head = next victim
        self.cached: dict[bytes, int] = {}
        self.stats = stats

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free_queue):
            return None
        out = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[block]
            if h is not None:
                del self.cached[h]
                self.block_hash[block] = None
                self.stats.evictions += 1
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference of each block, in eviction order (first released = first evicted)."""
        for b in blocks:
            self.ref_cnt[b] -= 1
            assert self.ref_cnt[b] >= 0, f"block {b} released more often than held"
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None
                if self.block_hash[b] is None:
                    self.free_queue.move_to_end(b, last=False)

    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h)

    def register(self, block: int, h: bytes) -> None:
        self.block_hash[block] = h
        self.cached[h] = block


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes) -> bytes:
    """Chained content hash of one full block; `extra` (model, cache salt) enters via the chain root."""
    if parent is None:
        # the root is a digest of `extra`, not `extra` itself: raw bytes of variable length followed by
        # token digits would be ambiguous (salt "x" + [12, ...] vs salt "x1" + [2, ...])
        parent = hashlib.blake2b(b"root|" + extra, digest_size=16).digest()
    m = hashlib.blake2b(digest_size=16)
    m.update(parent)
    m.update(b",".join(str(t).encode() for t in token_ids))
    return m.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, model_key: str = ""):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.model_key = model_key
        self.stats = PrefixCacheStats()
        self.pool = BlockPool(num_blocks, self.stats)
        self._pending_copies: list[tuple[int, int]] = []

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_shared_blocks(self) -> int:
        return sum(1 for r in self.pool.ref_cnt if r > 1)

    def block_hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """Hashes of the first `num_blocks` full blocks of `req` (computed lazily, memoized)."""
        bs = self.block_size
        hashes = req.block_hashes
        extra = f"{self.model_key}|{req.cache_salt or ''}".encode()
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, req.all_token_ids[i * bs : (i + 1) * bs], extra))
        return hashes[:num_blocks]

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request that holds no blocks: (block ids, tokens covered).

        At least the last token is always left to compute (its logits are needed)."""
        if not self.enable_prefix_caching or req.block_ids:
            return [], 0
        hits: list[int] = []
        for h in self.block_hashes(req, (req.num_tokens - 1) // self.block_size):
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    # ---- mutations -----------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int, new_computed_blocks: list[int] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (and the given hit
        blocks, for a request being admitted). False = does not fit; then nothing changed."""
        bs = self.block_size
        num_hit_tokens = len(new_computed_blocks) * bs
        total = req.num_computed_tokens + num_hit_tokens + num_new_tokens
        have = len(req.block_ids) + len(new_computed_blocks)
        need = max(0, self.blocks_for(total) - have)
        # a write into a shared block needs a private copy first
        write_block = (req.num_computed_tokens + num_hit_tokens) // bs
        cow = write_block < len(req.block_ids) and self.pool.ref_cnt[req.block_ids[write_block]] > 1
        reclaimable = sum(1 for b in new_computed_blocks if self.pool.ref_cnt[b] == 0)
        if need + cow > self.pool.num_free - reclaimable:
            return False
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            req.block_ids.extend(new_computed_blocks)
        if cow:
            src = req.block_ids[write_block]
            (dst,) = self.pool.allocate(1)
            if (req.num_computed_tokens + num_hit_tokens) % bs:
                self._pending_copies.append((src, dst))
                self.stats.cow_copies += 1
            req.block_ids[write_block] = dst
            self.pool.release([src])
        if need:
            req.block_ids.extend(self.pool.allocate(need))
        return True

    def cache_blocks(self, req: Request) -> None:
        """Register the request's newly full, computed blocks; merge duplicates into cached ones."""
        if not self.enable_prefix_caching:
            return
        # accepted draft tokens are computed before they are appended: hash only known tokens
        num_full = min(min(req.num_computed_tokens, req.num_tokens) // self.block_size, len(req.block_ids))
        if num_full <= req.num_cached_blocks:
            return
        hashes = self.block_hashes(req, num_full)
        for i in range(req.num_cached_blocks, num_full):
            block, h = req.block_ids[i], hashes[i]
            if self.pool.block_hash[block] == h:
                continue  # a prefix hit or a shared (forked) block: already registered
            existing = self.pool.lookup(h)
            if existing is None:
                self.pool.register(block, h)
            elif existing != block:
                self.pool.touch([existing])
                req.block_ids[i] = existing
                self.pool.release([block])
                self.stats.dedup_merges += 1
        req.num_cached_blocks = num_full

    def free(self, req: Request) -> None:
        """Release a request's blocks, tail first so tails are evicted first."""
        self.pool.release(reversed(req.block_ids))
        req.block_ids = []
        req.num_cached_blocks = 0

    def fork(self, parent: Request, child: Request) -> None:
        """`child` shares every block of `parent`; writes into shared blocks copy first."""
        assert not child.block_ids, f"fork target {child.request_id!r} already holds blocks"
        self.pool.touch(parent.block_ids)
        child.block_ids = list(parent.block_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks

    def take_pending_copies(self) -> list[tuple[int, int]]:
        out, self._pending_copies = self._pending_copies, []
        return out
