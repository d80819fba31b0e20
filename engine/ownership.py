"""Program ownership of KV blocks: reservations, pins and give-way (mechanism; how much to reserve and how
long to pin is decided above the engine). `KVCacheManager` owns one `Ownership` and delegates to it.

Retention (per program, "owner"): with a TTL set (`Pin`), a finished call's full cached blocks stay
pinned (the pin holds a reference) until `now + ttl_s`; the program's next admitted call dissolves the
pin (its hits now hold what it needs); `expire_pins` (every step) drops expired pins unless the program
has a call waiting; `Release` and program end drop them at once.

Pressure (`give_way`): when a request does not fit, the pool gives way in this order, before anyone is
preempted or has to wait: (1) pinned blocks no one else holds, the latest-started program's pin first,
each pin from its tail (the deepest blocks; its prefix stays useful); (2) only where the scheduler allows
it (a running request that would otherwise be preempted, or an otherwise idle engine), other programs'
unused reservations, the latest made first. A pin never blocks a request that could otherwise run; a
reservation never deadlocks the engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from agentrt.engine.block_pool import BlockPool
from agentrt.engine.program_ops import EndProgram, Pin, ProgramOp, Release, Reserve, StartProgram
from agentrt.engine.request import Request


PinFilter = Callable[[str], bool] | None  # which programs' pins may give way (None: every program's)


@dataclass(slots=True)
class RetentionStats:
    pins: int = 0  # calls that ended with their blocks pinned
    ttl_hits: int = 0  # admitted calls whose program's pin was still there
    ttl_misses: int = 0  # admitted calls whose program had pinned, but the pin had expired or given way
    expiries: int = 0  # pins dropped at their deadline
    pin_blocks_given_way: int = 0  # pinned blocks released under pressure
    reserved_blocks_given_way: int = 0  # unused reserved blocks taken by others under pressure
    recomputed_prefill_tokens: int = 0  # prompt tokens a program had computed in its last call, computed again
    tier_loaded_tokens: int = 0  # prompt tokens loaded from the KV tiers below the cache instead of recomputed


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
    tier_loaded_tokens: int = 0


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


class Ownership:
    """The programs (owners) of one block pool: their reservations (kept by the pool), pins and what
    their last call computed (reused by the next one's prefix lookup)."""

    def __init__(self, pool: BlockPool, block_size: int, max_reserved_blocks: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_reserved_blocks = max_reserved_blocks  # all reservations together
        self.retention = RetentionStats()
        self.owners: dict[str, _Owner] = {}  # programs started (StartProgram or any op), until they end
        self._pinned: dict[str, _Owner] = {}  # owners with a non-empty pin
        self._owner_seq = 0
        self._common_memo: tuple[Request, list[int], int, int] | None = None  # see _common_with_last

    @property
    def num_pinned_blocks(self) -> int:
        return len({b for o in self._pinned.values() for b in o.pin})

    @property
    def num_reserved_blocks(self) -> int:
        return sum(r.size for r in self.pool.reservations.values())

    def holds_pin(self, owner: str | None) -> bool:
        """Does `owner` (a program) have pinned blocks now?"""
        return owner in self._pinned

    def num_allocatable(self, owner: str | None, protect: list[int] = (), pins: PinFilter = None) -> int:
        """Blocks a request of `owner` could get now: free and not reserved by others, plus pinned blocks
        that would give way (not those in `protect`: a waiting request's own prefix hits, which it
        reuses rather than takes; with `pins`, only the pins of programs it accepts)."""
        return self.pool.available_to(owner) + self._num_pin_victims(owner, protect, pins)

    def _pins(self, pins: PinFilter):
        """The pinned owners `pins` accepts (all of them, not copied, without a filter)."""
        return self._pinned.values() if pins is None else [o for pid, o in self._pinned.items() if pins(pid)]

    def _num_pin_victims(self, owner: str | None, protect: list[int] = (), pins: PinFilter = None) -> int:
        """len(_pin_victims(owner, protect, pins)), without sorting (the scheduler asks every step)."""
        ref_cnt, reserved_by = self.pool.ref_cnt, self.pool.reserved_by
        owners = self._pins(pins)
        if not self.pool.reservations:  # no block is drawn from a reservation: owners need no look
            n = sum(1 for o in owners for b in o.pin if ref_cnt[b] == 1)
        else:
            n = sum(1 for o in owners for b in o.pin if ref_cnt[b] == 1 and reserved_by[b] in (None, owner))
        return n - sum(1 for b in set(protect) if ref_cnt[b] == 1 and self.pool.reserved_by[b] in (None, owner)
                       and any(b in o.pin for o in owners))

    def owner_kv(self, owner: str) -> OwnerKV:
        o = self.owners.get(owner)
        r = self.pool.reservations.get(owner)
        st = o.stats if o is not None else RetentionStats()
        return OwnerKV(
            self.pool.held.get(owner, 0), len(o.pin) if o is not None else 0, r.size if r else 0, r.used if r else 0,
            o.ttl_s if o is not None else 0.0, st.ttl_hits, st.ttl_misses, st.expiries, st.recomputed_prefill_tokens,
            st.tier_loaded_tokens,
        )

    def reuse_last_hashes(self, req: Request) -> None:
        """A program's next prompt extends its last call: give it those block hashes instead of rehashing a
        context of tens of thousands of tokens every call (a request with no hashes yet, same cache key)."""
        o = self.owners.get(req.program_id) if req.program_id is not None else None
        if o is not None and o.last_tokens is not None and not req.block_hashes and o.last_key == req.cache_key:
            n = self._common_with_last(req, o) // self.block_size
            req.block_hashes = o.last_hashes[:n]

    def call_ended(self, req: Request, now: float) -> None:
        """A call finished (its blocks about to be freed): its program remembers what it computed, and with
        a TTL its full cached blocks are pinned until `now + ttl_s`."""
        o = self.owners.get(req.program_id) if req.program_id is not None else None
        if o is None:
            return
        o.last_tokens, o.last_len = req.all_token_ids, req.num_computed_tokens  # a finished call's ids stay put
        o.last_hashes, o.last_key = req.block_hashes, req.cache_key
        if o.ttl_s > 0:
            keep = [b for b in reversed(req.held_blocks()) if self.pool.block_hash[b] is not None and b not in o.pin]
            self.pool.touch(keep)
            o.pin.update(dict.fromkeys(keep))
            o.deadline = now + o.ttl_s
            o.armed = True
            self.retention.pins += 1
            if o.pin:
                self._pinned[req.program_id] = o

    def admitted(self, req: Request, num_hit_tokens: int) -> None:
        """A request was admitted for the first time with `num_hit_tokens` from the cache: its program's
        pin has done its job (hit) or is gone (miss); count what it computes again."""
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
        loaded = min(req.num_tier_loaded_tokens, num_hit_tokens)
        o.stats.tier_loaded_tokens += loaded
        self.retention.tier_loaded_tokens += loaded
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
            if pid in self.pool.reservations:
                self.pool.unreserve(pid)
            return
        o = self.owners.get(pid)
        if o is None:
            self._owner_seq += 1
            o = self.owners[pid] = _Owner(self._owner_seq)
        if isinstance(op, StartProgram):
            return
        if isinstance(op, Reserve):
            blocks = -(-op.num_tokens // self.block_size)
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

    def _pin_victims(self, owner: str | None, protect, pins: PinFilter = None) -> list[tuple[str, int]]:
        """(pin owner, block) pairs that would free a block for `owner` if unpinned, in give-way order (of the
        programs `pins` accepts, when given)."""
        pool = self.pool
        out = []
        for pid, o in sorted(self._pinned.items(), key=lambda kv: -kv[1].seq):
            if pins is not None and not pins(pid):
                continue
            for b in reversed(o.pin):
                if pool.ref_cnt[b] == 1 and b not in protect and pool.reserved_by[b] in (None, owner):
                    out.append((pid, b))
        return out

    def give_way(self, short: int, owner: str | None, protect, may_take_reserved: bool,
                  may_take_pinned: bool | Callable[[str], bool] = True) -> bool:
        """Free `short` blocks for `owner` from pins (then others' unused reservations) if that suffices.
        `may_take_pinned`: every pin may give way (True), none (False), or those of the programs it accepts."""
        protect = set(protect)
        pins = may_take_pinned if callable(may_take_pinned) else None
        victims = self._pin_victims(owner, protect, pins) if may_take_pinned else []
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
