"""Paged KV-cache bookkeeping: prefix cache, dedup, fork and copy-on-write, and per-program
reservations and pins (the block pool itself is `engine.block_pool`).

The scheduler talks to `KVCacheManager` through named calls only, never its attributes, free lists or
hashes: blocks (`get_computed_blocks`, `allocate_slots`, `cache_blocks`, `free`, `fork`,
`take_pending_copies`, `capacity_error`), in-batch prefix sharing (`next_block_hash`,
`hashes_completed`) and ownership (`admitted`, `holds_pin`, `fits_whole`, `num_allocatable`,
`num_reserved_blocks`, `expire_pins`, `program_op`).

Program ownership (reservations, pins that give way under pressure, retention TTLs) lives in
`engine.ownership`; this manager owns one `Ownership` and delegates the program calls to it.

Invariants (checked by tests/engine/test_kv_cache_manager*.py):
- ref_cnt[b] == number of block tables holding b; a block is in the free queue iff ref_cnt == 0.
- The hash index maps each hash to exactly one block, and that block's content hashes to it.
- Free queue order is eviction order: blocks without a hash first (nothing to lose), then cached
  blocks least recently freed first; a request frees its tail first, so tails are evicted first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from agentrt.engine.block_pool import BlockPool, PrefixCacheStats
from agentrt.engine.kv_layout import NULL_BLOCK, KVLayout
from agentrt.engine.kv_tiers import KVTiers, Moves
from agentrt.engine.ownership import OwnerKV, Ownership, PinFilter, RetentionStats
from agentrt.engine.program_ops import ProgramOp
from agentrt.engine.request import Request

__all__ = ["BlockPool", "Hits", "KVCacheManager", "OwnerKV", "PrefixCacheStats", "RetentionStats", "hash_block"]


EXACT_WINDOW_BLOCKS = 2  # the last full blocks of a call a lossy KV tier keeps exact (the recent window)
HOT_BLOCKS = 2  # the last blocks of a prefix hit copied into T0 where the rest is read from T1 in place


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes) -> bytes:
    """Chained content hash of one full block; `extra` (model, cache salt, adapter) enters via the chain root."""
    if parent is None:
        # the root is a digest of `extra`, not `extra` itself: raw bytes of variable length followed by
        # token digits would be ambiguous (salt "x" + [12, ...] vs salt "x1" + [2, ...])
        parent = hashlib.blake2b(b"root|" + extra, digest_size=16).digest()
    m = hashlib.blake2b(digest_size=16)
    m.update(parent)
    m.update(",".join(map(str, token_ids)).encode())  # the ids' decimal digits, comma-separated
    return m.digest()


def group_hash(h: bytes, group: int) -> bytes:
    """The hash a block of layer group `group` is cached under: group 0's is the chain hash itself, the others'
    a digest of it and the group (each group's pages hold other layers' K/V for the same tokens)."""
    return h if group == 0 else hashlib.blake2b(h + group.to_bytes(2, "little"), digest_size=16).digest()


class Hits(list):
    """A prefix hit: group 0's cached blocks (a list, as with one group), and `extra`, the other groups' tables for
    the same positions (NULL_BLOCK where a window group needs no block)."""

    __slots__ = ("extra",)

    def __init__(self, blocks=(), extra: list[list[int]] | None = None):
        super().__init__(blocks)
        self.extra = extra or []


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, model_key: str = "",
                 max_reserved_fraction: float = 0.5, tiers: KVTiers | None = None, layout: KVLayout | None = None,
                 superblock_blocks: int = 1, runs_evict_early: bool = False):
        if not 0 <= max_reserved_fraction < 1:
            raise ValueError(f"max_reserved_fraction must be in [0, 1), got {max_reserved_fraction!r}")
        self.block_size = block_size
        # the layer groups (engine.kv_layout): one block table per group per request; one group without a layout
        self.layout = layout if layout is not None else KVLayout.single(1)
        self.num_groups = self.layout.num_groups
        self._windowed = [g for g in range(self.num_groups) if self.layout.groups[g].window is not None]
        self.enable_prefix_caching = enable_prefix_caching
        self.model_key = model_key
        self.max_reserved_blocks = int(num_blocks * max_reserved_fraction)  # all reservations together
        self.stats = PrefixCacheStats()
        # in-place reads of T1 (engine.kv_tiers): its slots are block ids num_blocks... of one pool (one group only)
        self._in_place = tiers is not None and tiers.in_place and enable_prefix_caching
        if self._in_place and (self.num_groups > 1 or self._windowed):
            raise ValueError(f"in-place reads of the host KV tier need one full-attention layer group, got "
                             f"{self.num_groups} group(s) with windows {[g.window for g in self.layout.groups]}")
        self.pool = BlockPool(num_blocks, self.stats, in_place=tiers.host.num_slots if self._in_place else 0,
                              superblock_blocks=superblock_blocks, runs_evict_early=runs_evict_early)
        self.ownership = Ownership(self.pool, block_size, self.max_reserved_blocks)
        self.retention = self.ownership.retention
        self.owners = self.ownership.owners  # the same dict: programs started, until they end
        self._pending_copies: list[tuple[int, int]] = []
        # the KV hierarchy below the pool (engine.kv_tiers): evicted cached blocks are demoted, prefix lookups
        # go on below T0; only with prefix caching (blocks are found again by their hash)
        self.tiers = tiers if enable_prefix_caching else None
        if self.tiers is not None:
            self.pool.on_evict = self.tiers.demote
        if self._in_place:
            self.pool.on_hold = self.tiers.host.hold
        # a hybrid model's recurrent states (engine.recurrent_state.RecurrentStatePool), or None: prefix hits end at
        # a block boundary with a state snapshot (`usable_prefix`), a freed request's state slot goes back
        # (`on_free`), a fork copies its parent's (`on_fork`)
        self.states = None

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def windowed(self) -> bool:
        """Some layer group frees what left its window: it holds a prefill chunk's every block while the chunk
        runs, so a smaller chunk needs fewer blocks (the scheduler halves a chunk that does not fit)."""
        return bool(self._windowed)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def _pinned(self):
        return self.ownership._pinned

    @property
    def num_pinned_blocks(self) -> int:
        return self.ownership.num_pinned_blocks

    @property
    def num_reserved_blocks(self) -> int:
        return self.ownership.num_reserved_blocks

    def holds_pin(self, owner: str | None) -> bool:
        """Does `owner` (a program) have pinned blocks now?"""
        return self.ownership.holds_pin(owner)

    def num_allocatable(self, owner: str | None, protect: list[int] = (), pins: PinFilter = None) -> int:
        """Blocks a request of `owner` could get now (engine.ownership.Ownership.num_allocatable)."""
        return self.ownership.num_allocatable(owner, protect, pins)

    def owner_kv(self, owner: str) -> OwnerKV:
        return self.ownership.owner_kv(owner)

    def fits_whole(self, req: Request, hits: list[int], may_take_pinned: bool | Callable[[str], bool],
                   output_tokens: int | None = None, headroom: int = 0) -> bool:
        """Would a waiting request's whole prompt and output (`sampling.max_tokens`, at most `output_tokens` of it
        when given) fit, with the given hit blocks, in what its owner may take now (pins that would give way
        counted if `may_take_pinned`: all, or those of the programs it accepts), leaving `headroom` blocks of it?"""
        pins = may_take_pinned if callable(may_take_pinned) else None
        owner = req.program_id
        room = self.num_allocatable(owner, hits, pins) if may_take_pinned else self.pool.available_to(owner)
        return self.blocks_needed(req, hits, output_tokens) + headroom <= room

    def blocks_needed(self, req: Request, hits: list[int], output_tokens: int | None = None) -> int:
        """Blocks a waiting request's whole prompt and output (as in `fits_whole`) takes beyond its hit blocks
        (a free hit block counts: it leaves the free queue)."""
        output = req.sampling.max_tokens if output_tokens is None else min(req.sampling.max_tokens, output_tokens)
        total = min(req.num_tokens + output, req.max_model_len)
        live, reclaimable = self._hit_counts(hits)
        return self.blocks_for(total) - live + reclaimable

    def _hit_counts(self, hits: list[int]) -> tuple[int, int]:
        """(blocks, free blocks) among a prefix hit's blocks, every group's: free ones use up free room."""
        ref, nb = self.pool.ref_cnt, self.pool.num_blocks
        live = free = 0
        for t in (hits, *getattr(hits, "extra", ())):
            for b in t:
                if b >= 0:
                    live += 1
                    free += ref[b] == 0 and b < nb  # (an in-place id takes no room in the pool)
        return live, free

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` tokens holds between steps, over every layer group."""
        if self.num_groups == 1 and not self._windowed:
            return -(-num_tokens // self.block_size)
        return sum(self.layout.live_blocks(g, num_tokens, self.block_size) for g in range(self.num_groups))

    def capacity_error(self, req: Request) -> str | None:
        """Why `req` could never fit the cache, even alone (its prompt and whole output); None if it can."""
        return self.capacity_error_of(req.num_prompt_tokens, req.sampling.max_tokens, req.max_model_len,
                                      f"request {req.request_id!r}")

    def capacity_error_of(self, num_prompt_tokens: int, max_tokens: int, max_model_len: int,
                          what: str = "the request") -> str | None:
        """`capacity_error` before there is a Request (the engine's checks on the caller's thread: it reads only
        the cache's fixed shape)."""
        need = self.blocks_for(min(num_prompt_tokens + max_tokens, max_model_len))
        if need <= self.num_blocks:
            return None
        return (f"{what} needs {need} KV blocks for {num_prompt_tokens} prompt + {max_tokens} output tokens "
                f"(max_tokens={max_tokens}) but the cache has only {self.num_blocks} blocks of {self.block_size} "
                "tokens: lower max_tokens, shorten the prompt, or give the engine more KV memory")

    def next_block_hash(self, req: Request, num_hit_blocks: int) -> bytes | None:
        """The hash of a waiting request's first full block past its `num_hit_blocks` cached ones, if its
        computing would be shared (prefix caching on, and a full block before the last token); else None."""
        if not self.enable_prefix_caching or (num_hit_blocks + 1) * self.block_size >= req.num_tokens:
            return None
        return self.block_hashes(req, num_hit_blocks + 1)[-1]

    def hashes_completed(self, req: Request, num_new_tokens: int) -> list[bytes]:
        """Hashes of the full blocks of `req` that computing its next `num_new_tokens` tokens completes."""
        bs = self.block_size
        first, end = req.num_computed_tokens // bs, min(req.num_computed_tokens + num_new_tokens, req.num_tokens) // bs
        return self.block_hashes(req, end)[first:] if end > first else []

    def num_shared_blocks(self) -> int:
        return sum(1 for r in self.pool.ref_cnt if r > 1)

    def block_hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """Hashes of the first `num_blocks` full blocks of `req` (computed lazily, memoized)."""
        bs = self.block_size
        hashes = req.block_hashes
        extra = f"{self.model_key}|{req.cache_key}".encode()
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, req.all_token_ids[i * bs : (i + 1) * bs], extra))
        return hashes[:num_blocks]

    def get_computed_blocks(self, req: Request, may_take_pinned: bool | Callable[[str], bool] = False
                            ) -> tuple[list[int], int]:
        """Longest cached prefix of a request that holds no blocks: (block ids, tokens covered).

        At least the last token is always left to compute (its logits are needed). With KV tiers, blocks found
        below T0 are loaded into free blocks, and into pinned blocks that give way if `may_take_pinned` (the
        request would take them for computing anyway)."""
        p = req.sampling
        if (not self.enable_prefix_caching or req.block_ids or p.prompt_logprobs is not None
                or (p.pooling is not None and not p.pooling.reads_cache)):
            return [], 0  # prompt_logprobs, mean / cls pooling: those prompt positions' rows are needed
        self.ownership.reuse_last_hashes(req)
        hashes = self.block_hashes(req, (req.num_tokens - 1) // self.block_size)
        if self.num_groups > 1 or self._windowed:  # (a hybrid model of several groups is refused at start-up)
            return self._group_hits(req, hashes, may_take_pinned)
        hits: list[int] = []
        for h in hashes:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        if self.tiers is not None and len(hits) < len(hashes):
            req.num_tier_loaded_tokens += self._promote(hashes, hits, req.program_id, may_take_pinned) * self.block_size
        if self.states is not None:  # resume only where a recurrent-state snapshot is kept
            del hits[self.states.usable_prefix(hashes[: len(hits)]) :]
        return hits, len(hits) * self.block_size

    def _group_hits(self, req: Request, hashes: list[bytes], may_take_pinned) -> tuple[Hits, int]:
        """get_computed_blocks with layer groups: the longest prefix of n blocks such that every full group has
        its n blocks cached and every window group the blocks its window sees from position n * block_size (the
        ones before it left the window long ago; they are NULL_BLOCK in its table). Group 0, when full, goes
        down the chain (and the tiers) as with one group; the other groups are looked up in T0."""
        bs, layout, lookup = self.block_size, self.layout, self.pool.lookup
        full0 = layout.groups[0].window is None
        chain: list[int] = []
        if full0:
            for h in hashes:
                b = lookup(h)
                if b is None:
                    break
                chain.append(b)
            if self.tiers is not None and len(chain) < len(hashes):
                req.num_tier_loaded_tokens += self._promote(hashes, chain, req.program_id, may_take_pinned) * bs
        n = len(chain) if full0 else len(hashes)
        others = range(1 if full0 else 0, self.num_groups)
        found: dict[tuple[int, int], int] = {}  # (group, block index) -> cached block
        if self.tiers is not None and n > 0:
            # the other groups' blocks the boundary needs, loaded from below T0 where demoted (each group's run
            # from its window's first block; a run stops at its first block found nowhere, capping the boundary)
            loaded, held = 0, list(chain)
            self.pool.touch(held)  # what is found stays while the next group's loads take free blocks
            try:
                for g in others:
                    lo = layout.first_needed_block(g, n * bs, bs)
                    run: list[int] = []
                    loaded += self._promote([group_hash(h, g) for h in hashes[lo:n]], run, req.program_id,
                                            may_take_pinned)
                    self.pool.touch(run)
                    held.extend(run)
                    found.update({(g, lo + k): b for k, b in enumerate(run)})
            finally:
                self.pool.release(reversed(held))
            req.num_tier_loaded_tokens += loaded * bs
        while n > 0:
            missing = -1
            for g in others:
                for i in range(n - 1, layout.first_needed_block(g, n * bs, bs) - 1, -1):
                    b = found.get((g, i))
                    if b is None:
                        b = lookup(group_hash(hashes[i], g))
                        if b is None:
                            missing = max(missing, i)
                            break
                        found[g, i] = b
            if missing < 0:
                break
            n = missing  # a boundary before the missing block
        tables = []
        for g in range(self.num_groups):
            if g == 0 and full0:
                tables.append(chain[:n])
                continue
            lo = min(n, layout.first_needed_block(g, n * bs, bs))
            tables.append([NULL_BLOCK] * lo + [found[g, i] for i in range(lo, n)])
        return Hits(tables[0], tables[1:]), n * bs

    def prefetch(self, req: Request) -> None:
        """A request arrived: have the tiers read ahead the disk blocks of its prompt past its T0 hits (engine.kv_tiers;
        nothing without a disk tier)."""
        if self.tiers is None or self.tiers.disk is None or req.block_ids:
            return
        hashes = self.block_hashes(req, (req.num_tokens - 1) // self.block_size)
        lookup = self.pool.lookup
        todo = [h for h in hashes if lookup(h) is None]  # those T0 holds are not read again
        if todo:
            self.tiers.prefetch(todo)

    def _promote(self, hashes: list[bytes], hits: list[int], owner: str | None = None,
                 may_take_pinned: bool | Callable[[str], bool] = False) -> int:
        """Extend `hits` (T0 hits of `hashes`' head) with the blocks found below T0, each loaded into a free T0
        block and registered there (a cached, unreferenced block, like any other hit: the caller takes it or the
        LRU does); blocks of the chain still in T0 past a demoted one are taken as they are. With in-place reads
        (engine.kv_tiers), a T1 block that is neither the sequence's first nor one of the last `HOT_BLOCKS` of the
        chain found is named where it lies instead (an in-place id, unreferenced like the rest; counted when a
        request takes it, `_took_in_place`). Stops at the first block found nowhere, when no block is free for a
        copy, or when loading would cost more than recomputing. Returns how many blocks it loaded."""
        pool, tiers = self.pool, self.tiers
        loaded = 0
        hot_from = 0  # chain index from which T1 blocks are copied, not read in place (the recent window)
        if self._in_place and tiers.in_place_base is not None:
            if tiers.in_place_base != pool.num_blocks:
                raise RuntimeError(f"the host tier's slots start at block {tiers.in_place_base}, the pool's in-place "
                                   f"ids at {pool.num_blocks}")
            end = len(hits)
            while end < len(hashes) and (pool.lookup(hashes[end]) is not None or tiers.has(hashes[end])):
                end += 1
            hot_from = end - HOT_BLOCKS
        pool.touch(hits)  # the hits must not be evicted to make room for the rest
        try:
            for i in range(len(hits), len(hashes)):
                h = hashes[i]
                b = pool.lookup(h)
                if b is not None:
                    pool.touch([b])
                    hits.append(b)
                    continue
                where = tiers.lookup(h)
                if where is None:
                    break
                if where[0] == 1 and 0 < i < hot_from:  # read where it lies: held from now (the touch) on
                    b = tiers.in_place_block(where[1])
                    pool.touch([b])
                    hits.append(b)
                    continue
                if not tiers.worth_loading(where[0]):
                    break
                if not pool.num_free and not (may_take_pinned and self.ownership.give_way(1, owner, hits, False, may_take_pinned)):
                    break
                tiers.loading = h  # the block `allocate` evicts must not take h's T1 slot
                try:
                    (b,) = pool.allocate(1)
                finally:
                    tiers.loading = None
                if not tiers.load(b, h, where):
                    pool.release([b])
                    break
                pool.register(b, h)
                hits.append(b)
                loaded += 1
        finally:
            pool.release(reversed(hits))  # the chain's tail first in the LRU, as `free` leaves it
        return loaded

    # ---- mutations -----------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int, new_computed_blocks: list[int] = (),
                       may_take_reserved: bool = False, may_take_pinned: bool | Callable[[str], bool] = True,
                       whole: bool = False, whole_output: int | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (and the given hit
        blocks, for a request being admitted). Pins give way if needed (unless not `may_take_pinned`; a
        predicate over program ids: only the pins of the programs it accepts);
        others' unused reservations too when `may_take_reserved` (module docstring); with `whole`, only
        if the request's whole prompt and output (at most `whole_output` output tokens) would fit
        (`fits_whole`). False = does not fit; then nothing changed."""
        if whole and not self.fits_whole(req, new_computed_blocks, may_take_pinned, whole_output):
            return False
        if self.num_groups > 1 or self._windowed:
            return self._allocate_groups(req, num_new_tokens, new_computed_blocks, may_take_reserved, may_take_pinned)
        bs = self.block_size
        num_hit_tokens = len(new_computed_blocks) * bs
        total = req.num_computed_tokens + num_hit_tokens + num_new_tokens
        have = len(req.block_ids) + len(new_computed_blocks)
        need = max(0, self.blocks_for(total) - have)
        # a write into a shared block needs a private copy first
        write_block = (req.num_computed_tokens + num_hit_tokens) // bs
        cow = write_block < len(req.block_ids) and self.pool.ref_cnt[req.block_ids[write_block]] > 1
        nb = self.pool.num_blocks
        reclaimable = sum(1 for b in new_computed_blocks if self.pool.ref_cnt[b] == 0 and b < nb)
        owner = req.program_id
        short = need + cow + reclaimable - self.pool.available_to(owner)
        if short > 0 and not self.ownership.give_way(short, owner, new_computed_blocks, may_take_reserved, may_take_pinned):
            return False
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks, owner)
            req.block_ids.extend(new_computed_blocks)
            if self._in_place:
                self._took_in_place(req, new_computed_blocks)
        if cow:
            src = req.block_ids[write_block]
            (dst,) = self.pool.allocate(1, owner)
            if (req.num_computed_tokens + num_hit_tokens) % bs:
                self._pending_copies.append((src, dst))
                self.stats.cow_copies += 1
            req.block_ids[write_block] = dst
            self.pool.release([src])
            req.blocks_version += 1
        if need:  # (a superblock pool continues the table where it ends: `after`)
            req.block_ids.extend(self.pool.allocate(need, owner, req.block_ids[-1] if req.block_ids else None))
        return True

    def _took_in_place(self, req: Request, hits: list[int]) -> None:
        """`req` took its prefix hits: those named in place count as T1 hits and loaded tokens now, once (a waiting
        request looks its prefix up at every step; a copy is counted when made, as it is made once)."""
        n = sum(1 for b in hits if b >= self.pool.num_blocks)
        if n:
            self.tiers.count_in_place(n)
            req.num_tier_loaded_tokens += n * self.block_size

    def _allocate_groups(self, req: Request, num_new_tokens: int, hits: list[int], may_take_reserved: bool,
                         may_take_pinned: bool | Callable[[str], bool]) -> bool:
        """allocate_slots with layer groups: each group's table grows to the new length (copy-on-write of a shared
        block being written, per group), and a window group first frees the blocks before what its window sees
        from the first position computed (they keep their hash: a cached, evictable block)."""
        bs, pool, layout = self.block_size, self.pool, self.layout
        extra = req.extra_tables if len(req.extra_tables) == self.num_groups - 1 else [[] for _ in range(self.num_groups - 1)]
        tables = [req.block_ids, *extra]
        hit_tables = [hits, *getattr(hits, "extra", ())] if hits else [[]] * self.num_groups
        start = req.num_computed_tokens + len(hits) * bs
        n_blocks = -(-(start + num_new_tokens) // bs)
        write_block = start // bs
        frees: list[tuple[list[int], int]] = []  # (table, index) of blocks that left a window
        need = cow = 0
        for g, (table, got) in enumerate(zip(tables, hit_tables, strict=True)):
            if g in self._windowed:  # what left the window: freed entries are always a prefix of the table
                i = min(len(table), layout.first_needed_block(g, start, bs)) - 1
                left = []
                while i >= 0 and table[i] >= 0:
                    left.append((table, i))
                    i -= 1
                frees.extend(reversed(left))
            need += max(0, n_blocks - len(table) - len(got))
            if write_block < len(table) and table[write_block] >= 0 and pool.ref_cnt[table[write_block]] > 1:
                cow += 1
        protect = [b for t in hit_tables for b in t if b >= 0]
        _, reclaimable = self._hit_counts(hits) if hits else (0, 0)
        returning = sum(1 for t, i in frees if pool.ref_cnt[t[i]] == 1)
        owner = req.program_id
        short = need + cow + reclaimable - returning - pool.available_to(owner)
        if short > 0 and not self.ownership.give_way(short, owner, protect, may_take_reserved, may_take_pinned):
            return False
        req.extra_tables = extra
        if frees:
            pool.release([t[i] for t, i in frees])  # oldest first: the first evicted
            for t, i in frees:
                t[i] = NULL_BLOCK
            # no version bump: a runner's kept row may go on naming the old block, which no query attends to
            # (rewriting a 32k-token request's rows every 16 tokens per group would cost a millisecond a step)
        if protect:
            pool.touch(protect, owner)
        for g, (table, got) in enumerate(zip(tables, hit_tables, strict=True)):
            table.extend(got)
            if write_block < len(table) and table[write_block] >= 0 and pool.ref_cnt[table[write_block]] > 1:
                src = table[write_block]
                (dst,) = pool.allocate(1, owner)
                if start % bs:
                    self._pending_copies.append((src, dst))
                    self.stats.cow_copies += 1
                table[write_block] = dst
                pool.release([src])
                req.blocks_version += 1
            if n_blocks > len(table):
                table.extend(pool.allocate(n_blocks - len(table), owner, table[-1] if table else None))
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
        for g, table in enumerate(req.tables):
            for i in range(req.num_cached_blocks, min(num_full, len(table))):
                block, h = table[i], group_hash(hashes[i], g)
                if block < 0 or block >= self.pool.num_blocks or self.pool.block_hash[block] == h:
                    continue  # left a window, read in place from T1, a prefix hit or a shared (forked) block:
                    # already registered
                existing = self.pool.lookup(h)
                if existing is None:
                    self.pool.register(block, h)
                    if self.tiers is not None:
                        self.tiers.cached(block, h)
                elif existing != block:
                    # merging a free cached block takes it from the free queue and gives `block` back: no
                    # net change, unless `block` is shared (then skip: others' reservations must stay whole).
                    # Give back first: a `block` drawn from the program's reservation returns its slot, which
                    # `existing` then draws. Taking first finds that reservation full and leaves `existing`
                    # untagged, and the release then reopens the slot: one unused reserved block more than free.
                    if self.pool.ref_cnt[existing] == 0 and self.pool.ref_cnt[block] > 1:
                        continue
                    self.pool.release([block])
                    self.pool.touch([existing], req.program_id)
                    table[i] = existing
                    self.stats.dedup_merges += 1
                    req.blocks_version += 1
        req.num_cached_blocks = num_full

    def free(self, req: Request, now: float = 0.0, retain: bool = True) -> None:
        """Release a request's blocks, tail first so tails are evicted first. A finished call
        (`retain`) of a program with a TTL leaves its full cached blocks pinned until `now + ttl_s`."""
        if retain:
            self.ownership.call_ended(req, now)
        if self.tiers is not None and self.tiers.lossy and req.num_cached_blocks:
            # a lossy tier keeps the attention sink (the first block) and the recent window (the last full blocks)
            # exact; flags that last while the blocks stay free (engine.kv_host.HostTier)
            n = req.num_cached_blocks
            for b in (req.block_ids[0], *req.block_ids[max(1, n - EXACT_WINDOW_BLOCKS) : n]):
                if b >= 0:
                    self.pool.exact[b] = True
        self.pool.release(req.held_blocks())
        if self.states is not None:
            self.states.on_free(req)
        req.block_ids = []
        req.extra_tables = []
        req.num_cached_blocks = 0
        req.blocks_version += 1

    def fork(self, parent: Request, child: Request) -> None:
        """`child` shares every block of `parent`; writes into shared blocks copy first."""
        assert not child.block_ids, f"fork target {child.request_id!r} already holds blocks"
        self.pool.touch(parent.held_blocks())
        child.block_ids = list(parent.block_ids)
        child.extra_tables = [list(t) for t in parent.extra_tables]
        child.blocks_version += 1
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks
        if self.states is not None:
            self.states.on_fork(parent, child)

    def reset_prefix_cache(self) -> bool:
        """Forget the hashes of the cached blocks no one holds (no later request hits them); blocks in use
        (block tables, pins) keep theirs. True when no cached block is left."""
        if self.states is not None:
            self.states.clear_snapshots()
        return self.pool.drop_unused_cached() == 0

    def take_pending_copies(self) -> list[tuple[int, int]]:
        out, self._pending_copies = self._pending_copies, []
        return out

    def take_tier_moves(self) -> Moves | None:
        """The copies between T0 and the tiers below that this step's scheduling implies (apply them before the
        forward, ahead of the copy-on-write copies); None without tiers."""
        return self.tiers.take_moves() if self.tiers is not None else None

    def cached_blocks(self) -> tuple[list[bytes], list[int]]:
        """Every block T0 holds a hash for (in use or free): (hashes, block ids)."""
        items = list(self.pool.cached.items())
        return [h for h, _ in items], [b for _, b in items]

    # ---- retention -----------------------------------------------------------------------

    # ---- program ownership (engine.ownership) ----------------------------------------------
    def admitted(self, req: Request, num_hit_tokens: int) -> None:
        """A request was admitted for the first time with `num_hit_tokens` from the cache: counted in the
        prefix-cache stats, and told to its program (its pin's hit or miss)."""
        self.stats.queries_tokens += req.num_prompt_tokens
        self.stats.hit_tokens += num_hit_tokens
        self.ownership.admitted(req, num_hit_tokens)

    def expire_pins(self, now: float, waiting_owners: set[str | None]) -> float:
        """Drop pins past their deadline, except those of programs with a call waiting (every step); the
        next deadline of those left (inf: none)."""
        return self.ownership.expire_pins(now, waiting_owners)

    def next_pin_deadline(self) -> float:
        return self.ownership.next_pin_deadline()

    def program_op(self, op: ProgramOp, now: float) -> None:
        """Apply one program operation (engine.program_ops) at engine time `now`."""
        self.ownership.program_op(op, now)
