"""The block pool: ref-counted KV blocks, an O(1) LRU free queue, the hash index, and who holds what.

Owners: a block taken from the free queue (allocated, or a prefix hit revived) is tagged with the
program whose request took it, until its last reference goes; `held[owner]` counts those blocks.
A block shared by several programs (a common system prompt) counts for the one that took it first.

Reservations: `reserve(owner, n)` sets `n` blocks aside for one owner. They are a count, not block
ids: blocks the owner takes while its reservation has room are tagged as drawn from it (`used`), and
the unused rest (`size - used`) is subtracted from what every other owner may take
(`available_to`). So `num_free >= unused_reserved()` always holds: a reservation can always be drawn.

In-place ids (a CPU engine whose host KV tier shares the KV tensor, engine.kv_tiers): ids `num_blocks ...
num_blocks + in_place - 1` name the host tier's slots where they lie. A block table holds one like any block
(ref-counted by `touch` / `release`, so every path that frees a table frees it), but it never enters the free
queue, has no owner or reservation and no hash here (the host tier indexes it); `on_hold(slot, held)` tells
the tier when its first reference comes and its last goes.

Invariants (tests/engine/test_kv_retention*.py):
- ref_cnt[b] == block tables holding b + pins holding b; b is in the free queue iff ref_cnt[b] == 0.
- A block in use has the owner it was taken for (or None); `held` counts exactly those.
- For each reservation, `used` == blocks tagged with it (all in use) <= `size`, and
  num_free >= Σ (size - used).

Superblocks (`superblock_blocks` S > 1, a power of two): the block stays the unit of hashing, matching, ref counts
and eviction; S blocks with ids `s*S .. s*S+S-1` (an aligned run) are the unit of allocation for long prefills, so a
sequence's table walks physically contiguous memory. `allocate(n, after=b)` takes, in turn:
1. the blocks right after `b` (the table's last block) while they are free: a chunked prefill or a decode growing by
   one block continues where its table ends;
2. when n >= 2, whole free aligned runs (the first blocks of one for a remainder under S), clean runs first, then
   runs whose newest cached block was freed longest ago (a heap of fully free runs, O(log n) per run);
3. the rest in the LRU free queue's order, as with S = 1.
Cached-but-free blocks: by default a block is taken out of LRU order (1 and 2) only when it has no hash or LRU would
evict it for this same allocation (it is among the first n of the free queue). Clean blocks sit at the queue's head,
so a window of n holding a cached block holds every clean one: a step takes LRU's n blocks in another order (or, with
clean blocks only in the window, other clean ones) and drops exactly the hashes LRU would. The cache holds what it
holds with S = 1 at every step (prefix hits are S = 1's); runs form where LRU's victims make them (a table's blocks
are freed at once, so they sit together in the queue). `runs_evict_early` takes any free run and continuation block,
cached or not (more contiguity, hashes dropped before their LRU turn: `bench paging` measures both). Run tails are
not held: a run's blocks past what the allocation needs stay free for whoever takes them.
Invariants (tests/engine/test_kv_superblocks.py): `_run_free[s]` == free blocks of run s; every fully free run has a
heap entry `(_run_age[s], s)`, `_run_age[s]` the newest free time of its cached blocks (-1: none).
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import islice


@dataclass(slots=True)
class PrefixCacheStats:
    queries_tokens: int = 0  # prompt tokens looked up on admission
    hit_tokens: int = 0  # of those, served from cache
    dedup_merges: int = 0  # full blocks merged into an identical cached block
    evictions: int = 0  # cached blocks whose hash was dropped to reuse them
    cow_copies: int = 0  # shared partial blocks copied before a write
    run_blocks: int = 0  # blocks handed out contiguously (superblock runs, a table's next block), not in LRU order


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

    def __init__(self, num_blocks: int, stats: PrefixCacheStats, in_place: int = 0, superblock_blocks: int = 1,
                 runs_evict_early: bool = False):
        if (isinstance(superblock_blocks, bool) or not isinstance(superblock_blocks, int) or superblock_blocks < 1
                or superblock_blocks & (superblock_blocks - 1)):
            raise ValueError(f"superblock_blocks must be a power of two >= 1, got {superblock_blocks!r}")
        self.num_blocks = num_blocks
        total = num_blocks + in_place  # in-place ids after the pool's own (module docstring)
        self.ref_cnt = [0] * total
        self.block_hash: list[bytes | None] = [None] * total
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head = next victim
        self.cached: dict[bytes, int] = {}
        self.stats = stats
        self.owner: list[str | None] = [None] * total  # program that took the block (while in use)
        self.reserved_by: list[str | None] = [None] * total  # reservation it was drawn from (while in use)
        self.held: Counter[str] = Counter()  # blocks in use per owner
        self.reservations: dict[str, Reservation] = {}
        self._unused_reserved = 0  # Σ unused over reservations, kept current
        self._seq = 0
        self.on_evict: Callable[[int, bytes, bool], None] | None = None  # a cached block is about to be reused (tiers)
        self.exact = [False] * total  # free blocks a lossy KV tier must keep exact (set by the KV manager)
        self.on_hold: Callable[[int, bool], None] | None = None  # an in-place id's first ref came / last went (tiers)
        # superblocks (module docstring); nothing of this is kept with S = 1
        self.superblock_blocks = superblock_blocks
        self.runs_evict_early = runs_evict_early
        S = superblock_blocks
        self._num_runs = num_blocks // S if S > 1 else 0  # whole aligned runs (a trailing partial one never is)
        self._run_free = [S] * self._num_runs  # free blocks per run
        self._run_age = [-1] * self._num_runs  # fully free run: newest `_freed_at` of its cached blocks, -1 if none
        self._free_runs = [(-1, s) for s in range(self._num_runs)]  # heap of (age, run), stale entries skipped
        self._clock = 0
        self._freed_at = [0] * num_blocks if S > 1 else []  # when each block last went free (its LRU position)

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
        if b >= self.num_blocks:  # an in-place id: the host tier's slot, held
            self.on_hold(b - self.num_blocks, True)
            return
        del self.free_queue[b]
        self.exact[b] = False
        self.owner[b] = owner
        if self._num_runs and b // self.superblock_blocks < self._num_runs:
            self._run_free[b // self.superblock_blocks] -= 1
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
        if b >= self.num_blocks:
            self.on_hold(b - self.num_blocks, False)
            return
        self.free_queue[b] = None
        if self.block_hash[b] is None:
            self.free_queue.move_to_end(b, last=False)
        if self.superblock_blocks > 1:
            self._clock += 1
            self._freed_at[b] = self._clock
            self._run_freed(b // self.superblock_blocks)
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

    def _run_freed(self, s: int) -> None:
        """A block of run `s` went free: when the whole run is, it enters the heap of free runs."""
        if s >= self._num_runs:
            return
        self._run_free[s] += 1
        S = self.superblock_blocks
        if self._run_free[s] == S:
            h, at = self.block_hash, self._freed_at
            age = max((at[b] for b in range(s * S, s * S + S) if h[b] is not None), default=-1)
            self._run_age[s] = age
            heapq.heappush(self._free_runs, (age, s))
            if len(self._free_runs) > 2 * self._num_runs + 64:  # stale entries: rebuild, amortized O(1) a push
                self._rebuild_runs()

    def _rebuild_runs(self) -> None:
        S = self.superblock_blocks
        self._free_runs = [(self._run_age[s], s) for s in range(self._num_runs) if self._run_free[s] == S]
        heapq.heapify(self._free_runs)

    def _evict(self, block: int) -> None:
        """A free block is about to be reused: its hash (if any) is dropped."""
        h = self.block_hash[block]
        if h is not None:
            del self.cached[h]
            self.block_hash[block] = None
            self.stats.evictions += 1
            if self.on_evict is not None:
                self.on_evict(block, h, self.exact[block])

    def _give(self, block: int, owner: str | None, out: list[int]) -> None:
        self._evict(block)
        self._take(block, owner)
        self.ref_cnt[block] = 1
        out.append(block)

    def allocate(self, n: int, owner: str | None = None, after: int | None = None) -> list[int] | None:
        """`n` free blocks for `owner`, or None if fewer are free. With superblocks, contiguous where it can
        (module docstring): first the blocks right after `after` (the caller's table's last block), then whole
        free runs when n >= 2; the rest, and everything with S = 1, in LRU order."""
        if n > len(self.free_queue):
            return None
        out: list[int] = []
        if self.superblock_blocks > 1 and (n >= 2 or (after is not None and after >= 0)):
            self._allocate_runs(n, owner, after, out)
        for _ in range(n - len(out)):
            self._give(next(iter(self.free_queue)), owner, out)
        return out

    def _allocate_runs(self, n: int, owner: str | None, after: int | None, out: list[int]) -> None:
        """Steps 1 and 2 of a superblock allocation (module docstring); appends to `out` what they take."""
        S, ref, h, at = self.superblock_blocks, self.ref_cnt, self.block_hash, self._freed_at
        horizon = None  # None: any cached block may go; else the newest free time LRU evicts for this allocation
        if not self.runs_evict_early:
            horizon = -1
            for b in islice(self.free_queue, n):  # cached free blocks sit in the queue in `_freed_at` order
                if h[b] is not None:
                    horizon = at[b]
        if after is not None and after >= 0:
            b = after + 1
            while (len(out) < n and b < self.num_blocks and ref[b] == 0
                   and (horizon is None or h[b] is None or at[b] <= horizon)):
                self._give(b, owner, out)
                b += 1
        if n >= 2:
            runs = self._free_runs
            while len(out) < n and runs:
                age, s = runs[0]
                if self._run_free[s] != S or self._run_age[s] != age:
                    heapq.heappop(runs)  # stale: taken from since it went free
                    continue
                if horizon is not None and age > horizon:
                    break  # the oldest free run holds a block LRU keeps longer: so do the others
                heapq.heappop(runs)
                for b in range(s * S, s * S + min(S, n - len(out))):
                    self._give(b, owner, out)
        self.stats.run_blocks += len(out)

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
        if self._num_runs and dropped:  # every free block is clean now: so is every fully free run
            self._run_age = [-1] * self._num_runs
            self._rebuild_runs()
        return len(self.cached)

    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h)

    def register(self, block: int, h: bytes) -> None:
        self.block_hash[block] = h
        self.cached[h] = block
