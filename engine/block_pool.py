"""The block pool: ref-counted KV blocks, an O(1) LRU free queue, the hash index, and who holds what.

Owners: a block taken from the free queue (allocated, or a prefix hit revived) is tagged with the
program whose request took it, until its last reference goes; `held[owner]` counts those blocks.
A block shared by several programs (a common system prompt) counts for the one that took it first.

Reservations: `reserve(owner, n)` sets `n` blocks aside for one owner. They are a count, not block
ids: blocks the owner takes while its reservation has room are tagged as drawn from it (`used`), and
the unused rest (`size - used`) is subtracted from what every other owner may take
(`available_to`). So `num_free >= unused_reserved()` always holds: a reservation can always be drawn.

Invariants (tests/engine/test_kv_retention*.py):
- ref_cnt[b] == block tables holding b + pins holding b; b is in the free queue iff ref_cnt[b] == 0.
- A block in use has the owner it was taken for (or None); `held` counts exactly those.
- For each reservation, `used` == blocks tagged with it (all in use) <= `size`, and
  num_free >= Σ (size - used).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefixCacheStats:
    queries_tokens: int = 0  # prompt tokens looked up on admission
    hit_tokens: int = 0  # of those, served from cache
    dedup_merges: int = 0  # full blocks merged into an identical cached block
    evictions: int = 0  # cached blocks whose hash was dropped to reuse them
    cow_copies: int = 0  # shared partial blocks copied before a write


@dataclass(slots=True)
class Reservation:
    size: int  # blocks set aside for the owner
    seq: int  # order made (give-way order: latest first)
    blocks: set[int] = field(default_factory=set)  # in-use blocks drawn from it; len == used

    @property
    def used(self) -> int:
        return len(self.blocks)

    @property
    def unused(self) -> int:
        return self.size - len(self.blocks)


class BlockPool:
    """Ref-counted blocks, an O(1) LRU free queue, the hash index, owners and reservations."""

    def __init__(self, num_blocks: int, stats: PrefixCacheStats):
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head = next victim
        self.cached: dict[bytes, int] = {}
        self.stats = stats
        self.owner: list[str | None] = [None] * num_blocks  # program that took the block (while in use)
        self.reserved_by: list[str | None] = [None] * num_blocks  # reservation it was drawn from (while in use)
        self.held: Counter[str] = Counter()  # blocks in use per owner
        self.reservations: dict[str, Reservation] = {}
        self._unused_reserved = 0  # Σ unused over reservations, kept current
        self._seq = 0
        self.on_evict: Callable[[int, bytes, bool], None] | None = None  # a cached block is about to be reused (tiers)
        self.exact = [False] * num_blocks  # free blocks a lossy KV tier must keep exact (set by the KV manager)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    # ---- reservations --------------------------------------------------------------------
    def unused_reserved(self, owner: str | None = None) -> int:
        """Unused reserved blocks: of `owner`'s reservation, or of all (owner None)."""
        if owner is None:
            return self._unused_reserved
        r = self.reservations.get(owner)
        return 0 if r is None else r.unused

    def available_to(self, owner: str | None) -> int:
        """Free blocks `owner` may take: the free queue less others' unused reservations."""
        own = self.reservations.get(owner) if owner is not None else None
        return len(self.free_queue) - self._unused_reserved + (own.unused if own is not None else 0)

    def reserve(self, owner: str, size: int) -> int:
        """Set `size` blocks aside for `owner` (replacing its reservation), clamped to what is free and not
        reserved by others (and never below what it already draws). Returns the size granted."""
        r = self.reservations.get(owner)
        used = 0 if r is None else r.used
        room = len(self.free_queue) - (self._unused_reserved - (0 if r is None else r.unused))
        size = max(used, min(size, used + room))
        if r is None:
            if size == 0:
                return 0
            self._seq += 1
            r = self.reservations[owner] = Reservation(0, self._seq)
        self._unused_reserved += (size - r.used) - r.unused
        r.size = size
        return size

    def unreserve(self, owner: str) -> None:
        """Drop `owner`'s reservation; the blocks drawn from it stay in use, untagged."""
        r = self.reservations.pop(owner, None)
        if r is None:
            return
        self._unused_reserved -= r.unused
        for b in r.blocks:
            self.reserved_by[b] = None

    def shrink_reservation(self, owner: str, n: int) -> None:
        """Give `n` unused reserved blocks of `owner` back to everyone (pressure)."""
        r = self.reservations[owner]
        n = min(n, r.unused)
        r.size -= n
        self._unused_reserved -= n

    # ---- blocks --------------------------------------------------------------------------
    def _take(self, b: int, owner: str | None) -> None:
        """Block `b` leaves the free queue for `owner`'s request."""
        del self.free_queue[b]
        self.exact[b] = False
        self.owner[b] = owner
        if owner is None:
            return
        self.held[owner] += 1
        r = self.reservations.get(owner)
        if r is not None and r.unused > 0:
            r.blocks.add(b)
            self.reserved_by[b] = owner
            self._unused_reserved -= 1

    def _put(self, b: int) -> None:
        """Block `b`'s last reference went: back to the free queue's tail, untagged."""
        self.free_queue[b] = None
        if self.block_hash[b] is None:
            self.free_queue.move_to_end(b, last=False)
        owner, self.owner[b] = self.owner[b], None
        if owner is not None:
            self.held[owner] -= 1
            if not self.held[owner]:
                del self.held[owner]
        res, self.reserved_by[b] = self.reserved_by[b], None
        if res is not None:
            r = self.reservations[res]
            r.blocks.discard(b)
            self._unused_reserved += 1

    def allocate(self, n: int, owner: str | None = None) -> list[int] | None:
        if n > len(self.free_queue):
            return None
        out = []
        for _ in range(n):
            block = next(iter(self.free_queue))
            h = self.block_hash[block]
            if h is not None:
                del self.cached[h]
                self.block_hash[block] = None
                self.stats.evictions += 1
                if self.on_evict is not None:
                    self.on_evict(block, h, self.exact[block])
            self._take(block, owner)
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[int], owner: str | None = None) -> None:
        for b in blocks:
            if self.ref_cnt[b] == 0:
                self._take(b, owner)
            self.ref_cnt[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference of each block, in eviction order (first released = first evicted)."""
        for b in blocks:
            self.ref_cnt[b] -= 1
            assert self.ref_cnt[b] >= 0, f"block {b} released more often than held"
            if self.ref_cnt[b] == 0:
                self._put(b)

    def drop_unused_cached(self) -> int:
        """Forget the hash of every free cached block (each moves to the free queue's head with the other
        blocks that have nothing to lose); how many cached blocks are left (all in use)."""
        dropped = [b for b in self.free_queue if self.block_hash[b] is not None]
        for b in reversed(dropped):  # keeps their order, ahead of the blocks that had no hash
            del self.cached[self.block_hash[b]]
            self.block_hash[b] = None
            self.free_queue.move_to_end(b, last=False)
        return len(self.cached)

    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h)

    def register(self, block: int, h: bytes) -> None:
        self.block_hash[block] = h
        self.cached[h] = block
