"""Paged KV-cache bookkeeping: prefix cache, dedup, fork and copy-on-write, and per-program
reservations and pins (the block pool itself is `engine.block_pool`).

The scheduler talks to `KVCacheManager` through named calls only, never its attributes, free lists or
hashes: blocks (`get_computed_blocks`, `allocate_slots`, `cache_blocks`, `free`, `fork`,
`take_pending_copies`, `capacity_error`), in-batch prefix sharing (`next_block_hash`,
`hashes_completed`) and ownership (`admitted`, `holds_pin`, `fits_whole`, `num_allocatable`,
`num_reserved_blocks`, `expire_pins`, `program_op`).

Retention (per program, "owner"): with a TTL set (`Pin`), a finished call's full cached blocks stay
pinned (the pin holds a reference) until `now + ttl_s`; the program's next admitted call dissolves the
pin (its hits now hold what it needs); `expire_pins` (every step) drops expired pins unless the program
has a call waiting; `Release` and program end drop them at once.

Pressure: when a request does not fit, the pool gives way in this order, before anyone is preempted or
has to wait: (1) pinned blocks no one else holds, the latest-started program's pin first, each pin from
its tail (the deepest blocks; its prefix stays useful); (2) only where the scheduler allows it (a
running request that would otherwise be preempted, or an otherwise idle engine), other programs'
unused reservations, the latest made first. A pin never blocks a request that could otherwise run;
a reservation never deadlocks the engine.

Invariants (checked by tests/engine/test_kv_cache_manager*.py):
- ref_cnt[b] == number of block tables holding b; a block is in the free queue iff ref_cnt == 0.
- The hash index maps each hash to exactly one block, and that block's content hashes to it.
- Free queue order is eviction order: blocks without a hash first (nothing to lose), then cached
  blocks least recently freed first; a request frees its tail first, so tails are evicted first.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from agentrt.engine.block_pool import BlockPool, PrefixCacheStats
from agentrt.engine.program_ops import EndProgram, Pin, ProgramOp, Release, Reserve, StartProgram
from agentrt.engine.request import Request

__all__ = ["BlockPool", "KVCacheManager", "OwnerKV", "PrefixCacheStats", "RetentionStats", "hash_block"]


@dataclass(slots=True)
class RetentionStats:
    pins: int = 0  # calls that ended with their blocks pinned
    ttl_hits: int = 0  # admitted calls whose program's pin was still there
    ttl_misses: int = 0  # admitted calls whose program had pinned, but the pin had expired or given way
    expiries: int = 0  # pins dropped at their deadline
    pin_blocks_given_way: int = 0  # pinned blocks released under pressure
    reserved_blocks_given_way: int = 0  # unused reserved blocks taken by others under pressure
    recomputed_prefill_tokens: int = 0  # prompt tokens a program had computed in its last call, computed again


@dataclass(slots=True)
class _Owner:
    seq: int  # start order: pins give way latest first
    ttl_s: float = 0.0  # pin a finished call's blocks this long (0: no pins)
    pin: dict[int, None] = field(default_factory=dict)  # pinned blocks, prefix order
    deadline: float = math.inf
    armed: bool = False  # a pin was made at its last call's end: hit or miss is told at its next admission
    last_tokens: list[int] | None = None  # token ids of its last finished call ...
    last_len: int = 0  # ... of which this many were computed
    last_hashes: list[bytes] = field(default_factory=list)  # ... and its block hashes (reused by the next call)
    last_key: str | None = None  # that call's Request.cache_key
    stats: RetentionStats = field(default_factory=RetentionStats)


@dataclass(slots=True)
class OwnerKV:
    """One program's KV, as the runtime shows it."""

    held: int  # blocks in use taken for its calls (pins included)
    pinned: int  # blocks its pin holds
    reserved: int  # blocks set aside for it
    reserved_used: int  # of those, in use
    ttl_s: float  # its retention TTL (0: none)
    ttl_hits: int
    ttl_misses: int
    expiries: int
    recomputed_prefill_tokens: int


def _common_prefix(prompt: list[int], last: list[int], last_len: int) -> int:
    """Length of the common prefix of `prompt` (less its last token, always computed) and `last[:last_len]`,
    by slice comparisons (C speed; contexts run to tens of thousands of tokens)."""
    lo, hi = 0, min(len(prompt) - 1, last_len)
    if prompt[:hi] == last[:hi]:
        return hi
    while lo < hi:  # prompt[:lo] matches, prompt[:hi] does not
        mid = (lo + hi + 1) // 2
        if prompt[lo:mid] == last[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


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


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, model_key: str = "",
                 max_reserved_fraction: float = 0.5):
        if not 0 <= max_reserved_fraction < 1:
            raise ValueError(f"max_reserved_fraction must be in [0, 1), got {max_reserved_fraction!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.model_key = model_key
        self.max_reserved_blocks = int(num_blocks * max_reserved_fraction)  # all reservations together
        self.stats = PrefixCacheStats()
        self.retention = RetentionStats()
        self.pool = BlockPool(num_blocks, self.stats)
        self.owners: dict[str, _Owner] = {}  # programs started (StartProgram or any op), until they end
        self._pinned: dict[str, _Owner] = {}  # owners with a non-empty pin
        self._owner_seq = 0
        self._pending_copies: list[tuple[int, int]] = []
        self._common_memo: tuple[Request, list[int], int, int] | None = None  # see _common_with_last

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_pinned_blocks(self) -> int:
        return len({b for o in self._pinned.values() for b in o.pin})

    @property
    def num_reserved_blocks(self) -> int:
        return sum(r.size for r in self.pool.reservations.values())

    def holds_pin(self, owner: str | None) -> bool:
        """Does `owner` (a program) have pinned blocks now?"""
        return owner in self._pinned

    def num_allocatable(self, owner: str | None, protect: list[int] = ()) -> int:
        """Blocks a request of `owner` could get now: free and not reserved by others, plus pinned blocks
        that would give way (not those in `protect`: a waiting request's own prefix hits, which it
        reuses rather than takes)."""
        return self.pool.available_to(owner) + self._num_pin_victims(owner, protect)

    def _num_pin_victims(self, owner: str | None, protect: list[int] = ()) -> int:
        """len(_pin_victims(owner, protect)), without sorting (the scheduler asks every step)."""
        ref_cnt, reserved_by = self.pool.ref_cnt, self.pool.reserved_by
        if not self.pool.reservations:  # no block is drawn from a reservation: owners need no look
            n = sum(1 for o in self._pinned.values() for b in o.pin if ref_cnt[b] == 1)
        else:
            n = sum(1 for o in self._pinned.values() for b in o.pin if ref_cnt[b] == 1 and reserved_by[b] in (None, owner))
        return n - sum(1 for b in set(protect) if ref_cnt[b] == 1 and self._is_pin_victim(b, owner))

    def _is_pin_victim(self, b: int, owner: str | None) -> bool:
        return self.pool.reserved_by[b] in (None, owner) and any(b in o.pin for o in self._pinned.values())

    def fits_whole(self, req: Request, hits: list[int], may_take_pinned: bool) -> bool:
        """Would a waiting request's whole prompt and output (`sampling.max_tokens`) fit, with the given
        hit blocks, in what its owner may take now (pins that would give way counted if `may_take_pinned`)?"""
        total = min(req.num_tokens + req.sampling.max_tokens, req.max_model_len)
        owner = req.program_id
        reclaimable = sum(1 for b in hits if self.pool.ref_cnt[b] == 0)
        room = self.num_allocatable(owner, hits) if may_take_pinned else self.pool.available_to(owner)
        return self.blocks_for(total) - len(hits) + reclaimable <= room

    def owner_kv(self, owner: str) -> OwnerKV:
        o = self.owners.get(owner)
        r = self.pool.reservations.get(owner)
        st = o.stats if o is not None else RetentionStats()
        return OwnerKV(
            self.pool.held.get(owner, 0), len(o.pin) if o is not None else 0, r.size if r else 0, r.used if r else 0,
            o.ttl_s if o is not None else 0.0, st.ttl_hits, st.ttl_misses, st.expiries, st.recomputed_prefill_tokens,
        )

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def capacity_error(self, req: Request) -> str | None:
        """Why `req` could never fit the cache, even alone (its prompt and whole output); None if it can."""
        max_tokens = min(req.num_prompt_tokens + req.sampling.max_tokens, req.max_model_len)
        need = self.blocks_for(max_tokens)
        if need <= self.num_blocks:
            return None
        return (f"request {req.request_id!r} needs {need} KV blocks for {req.num_prompt_tokens} prompt + "
                f"{req.sampling.max_tokens} output tokens but the cache has only {self.num_blocks} blocks of "
                f"{self.block_size} tokens")

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

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request that holds no blocks: (block ids, tokens covered).

        At least the last token is always left to compute (its logits are needed)."""
        p = req.sampling
        if (not self.enable_prefix_caching or req.block_ids or p.prompt_logprobs is not None
                or (p.pooling is not None and not p.pooling.reads_cache)):
            return [], 0  # prompt_logprobs, mean / cls pooling: those prompt positions' rows are needed
        o = self.owners.get(req.program_id) if req.program_id is not None else None
        if o is not None and o.last_tokens is not None and not req.block_hashes and o.last_key == req.cache_key:
            # the program's next prompt extends its last call: reuse those hashes instead of rehashing a
            # context of tens of thousands of tokens every call
            n = self._common_with_last(req, o) // self.block_size
            req.block_hashes = o.last_hashes[:n]
        hits: list[int] = []
        for h in self.block_hashes(req, (req.num_tokens - 1) // self.block_size):
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    # ---- mutations -----------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int, new_computed_blocks: list[int] = (),
                       may_take_reserved: bool = False, may_take_pinned: bool = True, whole: bool = False) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (and the given hit
        blocks, for a request being admitted). Pins give way if needed (unless not `may_take_pinned`);
        others' unused reservations too when `may_take_reserved` (module docstring); with `whole`, only
        if the request's whole prompt and output would fit (`fits_whole`). False = does not fit; then
        nothing changed."""
        if whole and not self.fits_whole(req, new_computed_blocks, may_take_pinned):
            return False
        bs = self.block_size
        num_hit_tokens = len(new_computed_blocks) * bs
        total = req.num_computed_tokens + num_hit_tokens + num_new_tokens
        have = len(req.block_ids) + len(new_computed_blocks)
        need = max(0, self.blocks_for(total) - have)
        # a write into a shared block needs a private copy first
        write_block = (req.num_computed_tokens + num_hit_tokens) // bs
        cow = write_block < len(req.block_ids) and self.pool.ref_cnt[req.block_ids[write_block]] > 1
        reclaimable = sum(1 for b in new_computed_blocks if self.pool.ref_cnt[b] == 0)
        owner = req.program_id
        short = need + cow + reclaimable - self.pool.available_to(owner)
        if short > 0 and not self._give_way(short, owner, new_computed_blocks, may_take_reserved, may_take_pinned):
            return False
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks, owner)
            req.block_ids.extend(new_computed_blocks)
        if cow:
            src = req.block_ids[write_block]
            (dst,) = self.pool.allocate(1, owner)
            if (req.num_computed_tokens + num_hit_tokens) % bs:
                self._pending_copies.append((src, dst))
                self.stats.cow_copies += 1
            req.block_ids[write_block] = dst
            self.pool.release([src])
        if need:
            req.block_ids.extend(self.pool.allocate(need, owner))
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
                # merging a free cached block takes it from the free queue and gives `block` back: no
                # net change, unless `block` is shared (then skip: others' reservations must stay whole)
                if self.pool.ref_cnt[existing] == 0 and self.pool.ref_cnt[block] > 1:
                    continue
                self.pool.touch([existing], req.program_id)
                req.block_ids[i] = existing
                self.pool.release([block])
                self.stats.dedup_merges += 1
        req.num_cached_blocks = num_full

    def free(self, req: Request, now: float = 0.0, retain: bool = True) -> None:
        """Release a request's blocks, tail first so tails are evicted first. A finished call
        (`retain`) of a program with a TTL leaves its full cached blocks pinned until `now + ttl_s`."""
        o = self.owners.get(req.program_id) if req.program_id is not None else None
        if retain and o is not None:
            o.last_tokens, o.last_len = req.all_token_ids, req.num_computed_tokens  # a finished call's ids stay put
            o.last_hashes, o.last_key = req.block_hashes, req.cache_key
            if o.ttl_s > 0:
                keep = [b for b in req.block_ids if self.pool.block_hash[b] is not None and b not in o.pin]
                self.pool.touch(keep)
                o.pin.update(dict.fromkeys(keep))
                o.deadline = now + o.ttl_s
                o.armed = True
                self.retention.pins += 1
                if o.pin:
                    self._pinned[req.program_id] = o
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

    def reset_prefix_cache(self) -> bool:
        """Forget the hashes of the cached blocks no one holds (no later request hits them); blocks in use
        (block tables, pins) keep theirs. True when no cached block is left."""
        return self.pool.drop_unused_cached() == 0

    def take_pending_copies(self) -> list[tuple[int, int]]:
        out, self._pending_copies = self._pending_copies, []
        return out

    # ---- retention -----------------------------------------------------------------------
    def admitted(self, req: Request, num_hit_tokens: int) -> None:
        """A request was admitted for the first time with `num_hit_tokens` from the cache: counted in the
        prefix-cache stats; its program's pin has done its job (hit) or is gone (miss); count what it
        computes again."""
        self.stats.queries_tokens += req.num_prompt_tokens
        self.stats.hit_tokens += num_hit_tokens
        o = self.owners.get(req.program_id) if req.program_id is not None else None
        if o is None:
            return
        if o.pin:
            o.stats.ttl_hits += 1
            self.retention.ttl_hits += 1
            self._unpin(req.program_id, o)
        elif o.armed:
            o.stats.ttl_misses += 1
            self.retention.ttl_misses += 1
        o.armed = False
        if o.last_tokens is not None:
            lost = max(0, self._common_with_last(req, o) - num_hit_tokens)
            o.stats.recomputed_prefill_tokens += lost
            self.retention.recomputed_prefill_tokens += lost

    def _common_with_last(self, req: Request, o: _Owner) -> int:
        """_common_prefix of `req`'s prompt and its program's last call, remembered for the admission that
        follows the lookup (both compare contexts of tens of thousands of tokens)."""
        memo = self._common_memo
        if memo is not None and memo[0] is req and memo[1] is o.last_tokens and memo[2] == o.last_len:
            return memo[3]
        n = _common_prefix(req.prompt_token_ids, o.last_tokens, o.last_len)
        self._common_memo = (req, o.last_tokens, o.last_len, n)
        return n

    def expire_pins(self, now: float, waiting_owners: set[str | None]) -> float:
        """Drop pins past their deadline, except those of programs with a call waiting (every step); the
        next deadline of those left (inf: none)."""
        for pid, o in list(self._pinned.items()):
            if o.deadline <= now and pid not in waiting_owners:
                o.stats.expiries += 1
                self.retention.expiries += 1
                self._unpin(pid, o)
        return self.next_pin_deadline()

    def next_pin_deadline(self) -> float:
        return min((o.deadline for o in self._pinned.values()), default=math.inf)

    def program_op(self, op: ProgramOp, now: float) -> None:
        """Apply one program operation (engine.program_ops) at engine time `now`."""
        pid = op.program_id
        if isinstance(op, EndProgram):
            o = self.owners.pop(pid, None)
            if o is not None:
                self._unpin(pid, o)
            self.pool.unreserve(pid)
            return
        o = self.owners.get(pid)
        if o is None:
            self._owner_seq += 1
            o = self.owners[pid] = _Owner(self._owner_seq)
        if isinstance(op, StartProgram):
            return
        if isinstance(op, Reserve):
            blocks = self.blocks_for(op.num_tokens)
            if blocks == 0:
                self.pool.unreserve(pid)
                return
            others = self.num_reserved_blocks - self.pool.reservations[pid].size if pid in self.pool.reservations else self.num_reserved_blocks
            self.pool.reserve(pid, min(blocks, max(0, self.max_reserved_blocks - others)))
        elif isinstance(op, Pin):
            o.ttl_s = float(op.ttl_s)
            if o.ttl_s == 0:
                self._unpin(pid, o)
            else:
                o.deadline = now + o.ttl_s
        elif isinstance(op, Release):
            o.ttl_s = 0.0
            self._unpin(pid, o)
        else:
            raise TypeError(f"not a program operation: {op!r}")

    def _unpin(self, pid: str, o: _Owner) -> None:
        blocks, o.pin = o.pin, {}
        self._pinned.pop(pid, None)
        self.pool.release(reversed(list(blocks)))

    def _pin_victims(self, owner: str | None, protect) -> list[tuple[str, int]]:
        """(pin owner, block) pairs that would free a block for `owner` if unpinned, in give-way order."""
        pool = self.pool
        out = []
        for pid, o in sorted(self._pinned.items(), key=lambda kv: -kv[1].seq):
            for b in reversed(o.pin):
                if pool.ref_cnt[b] == 1 and b not in protect and pool.reserved_by[b] in (None, owner):
                    out.append((pid, b))
        return out

    def _give_way(self, short: int, owner: str | None, protect, may_take_reserved: bool,
                  may_take_pinned: bool = True) -> bool:
        """Free `short` blocks for `owner` from pins (then others' unused reservations) if that suffices."""
        protect = set(protect)
        victims = self._pin_victims(owner, protect) if may_take_pinned else []
        others = sorted(((pid, r) for pid, r in self.pool.reservations.items() if pid != owner and r.unused),
                        key=lambda kv: -kv[1].seq) if may_take_reserved else []
        if len(victims) + sum(r.unused for _, r in others) < short:
            return False
        for pid, b in victims[:short]:
            o = self._pinned[pid]
            del o.pin[b]
            if not o.pin:
                del self._pinned[pid]
            self.pool.release([b])
            self.retention.pin_blocks_given_way += 1
        short -= min(short, len(victims))
        for pid, r in others:
            if short <= 0:
                break
            n = min(short, r.unused)
            self.pool.shrink_reservation(pid, n)
            self.retention.reserved_blocks_given_way += n
            short -= n
        return True
