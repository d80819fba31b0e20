"""The KV hierarchy below the engine's block pool: demote instead of drop, load instead of recompute.

Tiers (engine mechanism: they know blocks by content hash, not programs):
- T0: the engine's block pool (engine.block_pool), the only tier the model reads.
- T1 (`HostTier`, engine.kv_host): a second, larger pool of block slots in host memory (pinned beside a
  GPU), LRU.
- T2 (`DiskTier`, engine.kv_disk): content-hashed chunk files of up to `chunk_blocks` blocks in a directory that several
  engines on one host and a restarted engine share (the block hash has no seed; each file's header names the
  model, dtype and block shape and a CRC of every block, so a truncated, corrupt or foreign file is never
  served). Bounded by bytes, least recently used files deleted first. Written by a background thread.

Flow (`KVTiers`):
- Demote: a cached block the pool evicts to reuse (LRU eviction; expired pins and preempted calls leave
  their blocks cached in the free queue, so they leave T0 this way too) is copied to T1 and queued for T2.
  Its copy is a `Moves` entry the engine applies before the next forward, ahead of anything that writes
  the block; the disk write happens on the writer thread, never on the step path.
- Write-through to T2: a block T0 registers (full and computed) is queued for the disk at once, so another
  engine sharing the directory finds it while this one still holds it, and a restart (or a crash) loses
  only what the writer had not written yet.
- Promote: a prefix lookup that runs out of T0 hits goes on in T1 then T2; blocks found there are loaded
  into free T0 blocks (a T1 slot at the next `Moves.apply`, a disk block read and checked now) and
  registered, so the call sees them as ordinary prefix hits. Whether loading beats recomputing is decided
  from the measured cost of each (`KVTiers.worth_loading`).
- The hierarchy is inclusive: a promoted block keeps its T1 slot and its file.

A hybrid model's recurrent-state snapshots (engine.recurrent_state) go through T1 and T2 beside its blocks, in a
share of each tier's budget, keyed by the same chained block hash (engine.recurrent_tiers): a prefix hit below T0
resumes where both its blocks and the snapshot at its boundary are found.

In-place reads (`in_place`; a CPU engine with an exact host tier and one layer group): T1 is the same DRAM as
the pool, so its slots are allocated as the tail of the engine's KV tensor (`attach`: slot s is block
`in_place_base + s`) and a T1 hit is read where it lies: the request's block table names that id
(`in_place_block`), no copy is queued, and the pool ref-counts the id like a block (engine.block_pool), so the
slot is held (`HostTier.in_use`: never evicted, never written) until no table names it, on every path that
frees a table. Only full, immutable prefix blocks are read this way (a request writes only past its hits, in
blocks of its own); the hottest blocks of a hit (the sequence's first block, the sink and a program's head;
the last blocks before the boundary, the recent window) are still copied into T0 (KVCacheManager._promote),
where they stay cached beside the blocks the call computes. Disk hits are copied as before.

Invariants (tests/engine/test_kv_tiers.py): every T1 slot is either free or holds exactly one hash; the
disk index maps each hash to a file that lists it; the bytes of the files indexed never exceed the bound
after a write completes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from agentrt.engine.kv_disk import DiskTier, lowest_priority
from agentrt.engine.kv_host import HostTier, TierStats

logger = logging.getLogger("agentrt.engine")

STAGED_BYTES = 256 << 20  # disk blocks read ahead and not loaded yet, at most


def _gather(kv_cache: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    """Blocks of `kv_cache` ([layers, K/V, blocks, ...]) copied out, [n, layers, K/V, ...] on the CPU: one copy each."""
    out = torch.empty((len(blocks), *kv_cache.shape[:2], *kv_cache.shape[3:]), dtype=kv_cache.dtype)
    for i, b in enumerate(blocks):
        out[i].copy_(kv_cache[:, :, b])
    return out


@dataclass(slots=True)
class Moves:
    """Block copies between T0 and the tiers below to apply, in order, before the next forward: ("save", blocks,
    slots) copies T0 blocks into T1 slots (and hands the copies to the disk writer), ("write", blocks, None) hands
    copies of T0 blocks to the disk writer alone, ("load", blocks, slots) copies T1 slots into T0 blocks, ("put",
    blocks, data) writes blocks read from disk into T0."""

    ops: list[tuple[str, list[int], object]] = field(default_factory=list)
    saved_hashes: list[list[bytes]] = field(default_factory=list)  # per "save" op: the blocks' hashes

    def __bool__(self) -> bool:
        return bool(self.ops)


class KVTiers:
    """T1 and/or T2 under one block pool: the demote / promote bookkeeping and the copies it implies."""

    def __init__(self, block_shape: tuple[int, ...], dtype: torch.dtype, key: str, host_bytes: int = 0,
                 disk_dir: str | None = None, disk_bytes: int = 0, pin: bool = False, *, host_int8: bool = False,
                 host: HostTier | None = None, disk: DiskTier | None = None, prefetch: bool = True,
                 in_place: bool = False):
        """Tiers of the given sizes; or, for the simulator, the tier objects themselves (`host`, `disk`: a
        bookkeeping-only HostTier and a DiskTier stand-in) and no read-ahead thread (`prefetch` False).
        `in_place`: T1's slots are to be the tail of the engine's KV tensor (module docstring): the tier holds
        no memory of its own until `attach`."""
        if in_place and (host_int8 or not host_bytes or host is not None):
            raise ValueError("in-place reads need an exact host tier of its own size (host_bytes, not int8)")
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.block_bytes = int(torch.Size(block_shape).numel()) * dtype.itemsize
        if host is None and host_bytes and host_int8:
            slots, exact = HostTier.int8_slots(host_bytes, self.block_shape, dtype)
            host = HostTier(slots, self.block_shape, dtype, pin, int8=True, exact_slots=exact)
        elif host is None and host_bytes:
            host = HostTier(host_bytes // self.block_bytes, self.block_shape, dtype, pin, store=not in_place)
        if disk is None and disk_dir is not None:
            disk = DiskTier(disk_dir, disk_bytes, key, self.block_shape, dtype)
        self.host, self.disk = host, disk
        self.prefetch_enabled = prefetch
        self.loading: bytes | None = None  # the block a promotion is making room for: its T1 slot is not reused
        self.probe_s_per_block: dict[int, float] = {}  # tier -> load seconds a block, from `probe` (start-up)
        self._moves = Moves()
        self.recompute_s_per_token: float | None = None  # measured by the engine (prefill steps)
        # disk blocks read ahead for calls that wait (`prefetch`), by hash, oldest first; bounded
        self._staged: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._staged_lock = threading.Lock()
        self.max_staged = max(1, STAGED_BYTES // self.block_bytes)
        self.prefetched = 0  # blocks read ahead
        self.prefetch_used = 0  # of which loaded from the staging area
        self._reads: queue.Queue | None = None  # hashes to read ahead (a reader thread, started on first use)
        self.block_size = block_shape[2] if len(block_shape) > 2 else 1
        self.in_place = in_place
        self.in_place_base: int | None = None  # block id of T1 slot 0 in the engine's KV tensor (`attach`)

    def attach(self, kv_cache: torch.Tensor, base: int) -> None:
        """In-place reads: T1's slots are blocks `base ...` of `kv_cache` ([layers, K/V, blocks, ...])."""
        if not self.in_place:
            raise ValueError("attach: these tiers were not made for in-place reads")
        n = self.host.num_slots
        if kv_cache.shape[2] < base + n or (*kv_cache.shape[:2], *kv_cache.shape[3:]) != self.block_shape:
            raise ValueError(f"attach: a KV tensor of {tuple(kv_cache.shape)} has no {n} blocks of {self.block_shape} "
                             f"from block {base}")
        self.host.share(kv_cache[:, :, base : base + n].permute(2, 0, 1, *range(3, kv_cache.dim())))
        self.in_place_base = base

    def in_place_block(self, slot: int) -> int:
        """The block id a block table names to read T1 slot `slot` where it lies."""
        return self.in_place_base + slot

    def count_in_place(self, n: int) -> None:
        """A request took `n` blocks read in place (at admission: a waiting request finds them at every lookup)."""
        self.host.stats.hits += n
        self.host.stats.in_place += n

    def has(self, h: bytes) -> bool:
        """Is block `h` below T0 (no LRU refresh, no rescan: a look ahead, not a use)?"""
        return (self.host is not None and h in self.host.slots) or (self.disk is not None and self.disk.contains(h))
    # ---- bookkeeping (the pool's calls, engine thread) ----------------------------------------
    @property
    def lossy(self) -> bool:
        """Does a tier store blocks inexactly (an int8 host tier)?"""
        return self.host is not None and self.host.int8

    def demote(self, block: int, h: bytes, exact: bool = False) -> None:
        """The pool evicts cached block `block` (hash `h`) to reuse it: keep a copy below T0 (`exact`: at full
        precision even in a lossy tier)."""
        if self.host is not None:
            if self.host.get(h) is not None:
                return  # already there (inclusive)
            slot = self.host.put(h, exact, keep=self.loading)
            if slot is not None:
                self._append("save", block, slot, h)
                return
            self.host.stats.skipped += 1  # its only slot holds the block being loaded
            if self.disk is not None and not self.disk.contains(h):
                self._append("write", block, None, h)
        elif self.disk is not None and not self.disk.contains(h):
            self._append("write", block, None, h)

    def cached(self, block: int, h: bytes) -> None:
        """T0 registered a newly computed block: written through to the disk tier (so another engine on this host,
        or this one after a restart or a crash, finds it while T0 still holds it)."""
        if self.disk is not None and not self.disk.contains(h):
            self._append("write", block, None, h)

    def lookup(self, h: bytes) -> tuple[int, int | None] | None:
        """Where block `h` is below T0: (1, its T1 slot), (2, None) on disk, or None."""
        if self.host is not None:
            s = self.host.get(h)
            if s is not None:
                return 1, s
        if self.disk is not None:
            if not self.disk.contains(h):
                self.disk.maybe_rescan()  # another engine may have written it
            if self.disk.contains(h):
                return 2, None
        return None

    def load(self, block: int, h: bytes, where: tuple[int, int | None]) -> bool:
        """Fill T0 block `block` with block `h` from where `lookup` found it, before the next forward (a disk
        block is read and checked now); False if it cannot be (a corrupt or vanished file: recompute)."""
        tier, slot = where
        if tier == 1:
            self._append("load", block, slot)
            self.host.stats.hits += 1
            return True
        with self._staged_lock:
            data = self._staged.pop(h, None)
        if data is not None:
            self.prefetch_used += 1
        else:
            data = self.disk.read(h)
        if data is None:
            return False
        self._append("put", block, data)
        self.disk.count_hit()
        return True

    def prefetch(self, hashes: list[bytes]) -> None:
        """A call arrived (its program's tool returned): read the disk blocks of its prefix ahead, in the background,
        while it waits; those in T1 are a memory copy away and are left. Stops at the first block found nowhere."""
        if self.disk is None or not self.prefetch_enabled:
            return
        todo = []
        for h in hashes:
            if self.host is not None and h in self.host.slots:
                continue
            if not self.disk.contains(h):
                break
            todo.append(h)
        if not todo:
            return
        if self._reads is None:
            self._reads = queue.Queue()
            threading.Thread(target=self._read_loop, name="agentrt-kv-prefetch", daemon=True).start()
        self._reads.put(todo)

    def _read_loop(self) -> None:
        lowest_priority()  # as the writer: a read it has not done yet, admission does itself
        while True:
            hashes = self._reads.get()
            if hashes is None:
                return
            for h in hashes:
                with self._staged_lock:
                    if h in self._staged:
                        continue
                data = self.disk.read(h, timed=False)
                if data is None:
                    break
                with self._staged_lock:
                    self._staged[h] = data
                    self.prefetched += 1
                    while len(self._staged) > self.max_staged:
                        self._staged.popitem(last=False)

    def _append(self, kind: str, block: int, src: object, h: bytes | None = None) -> None:
        ops = self._moves.ops
        if ops and ops[-1][0] == kind:
            ops[-1][1].append(block)
            ops[-1][2].append(src)
        else:
            ops.append((kind, [block], [src]))
            if kind in ("save", "write"):
                self._moves.saved_hashes.append([])
        if kind in ("save", "write"):
            self._moves.saved_hashes[-1].append(h)

    def take_moves(self) -> Moves:
        out, self._moves = self._moves, Moves()
        return out

    def worth_loading(self, tier: int) -> bool:
        """Is loading a block from `tier` cheaper than recomputing it, by what was measured so far?"""
        cost = self.load_s_per_block(tier)
        if self.recompute_s_per_token is None or cost is None:
            return True  # nothing measured yet: loads cost microseconds a token, recomputing milliseconds
        return cost < self.recompute_s_per_token * self.block_size

    def load_s_per_block(self, tier: int) -> float | None:
        """What loading a block from `tier` costs: measured over the loads so far, else the start-up probe's."""
        t = self.host if tier == 1 else self.disk
        if t is None:
            return None
        st = t.stats
        copied = st.hits - st.in_place  # in-place reads cost nothing to load
        if copied >= 8:
            return st.load_s / copied
        return self.probe_s_per_block.get(tier)

    def reload_s_per_token(self) -> float | None:
        """What getting a token's KV back from the fastest tier costs (None: no tiers measured): the reload term of
        the retention TTL's cost model (Continuum: a cheaper reload shortens the best TTL)."""
        costs = [c for t in (1, 2) if (c := self.load_s_per_block(t)) is not None]
        return min(costs) / self.block_size if costs else None

    def probe(self) -> dict[int, float]:
        """Time loading one block from each tier (best of 3; the disk's through the page cache, as a block just
        written is read), for `worth_loading` before any load is measured."""
        block = torch.zeros(self.block_shape, dtype=self.dtype)
        if self.host is not None and self.host.data is not None:
            best = math.inf
            slot = self.host.free[-1] if self.host.free else 0
            for _ in range(3):
                t0 = time.perf_counter()
                self.host.write([slot], block[None])
                block.copy_(self.host.read([slot])[0])
                best = min(best, time.perf_counter() - t0)
            self.probe_s_per_block[1] = best
        if isinstance(self.disk, DiskTier):
            path = os.path.join(self.disk.dir, f"probe.{os.getpid()}.tmp")
            raw = block.view(torch.uint8).numpy().tobytes()
            best = math.inf
            try:
                with open(path, "wb") as f:
                    f.write(raw)
                for _ in range(3):
                    t0 = time.perf_counter()
                    with open(path, "rb") as f:
                        buf = bytearray(len(raw))
                        f.readinto(buf)
                    zlib.crc32(buf)
                    block.view(torch.uint8).view(-1).copy_(torch.frombuffer(buf, dtype=torch.uint8))
                    best = min(best, time.perf_counter() - t0)
                self.probe_s_per_block[2] = best
            except OSError as e:
                logger.warning("KV disk tier: the start-up probe failed (%s)", e)
            finally:
                with contextlib.suppress(OSError):
                    os.remove(path)
        return self.probe_s_per_block

    # ---- the copies (before the forward) ------------------------------------------------------
    def apply(self, moves: Moves, kv_cache: torch.Tensor) -> None:
        """Apply `moves` to `kv_cache` ([layers, K/V, blocks, block_size, heads, head_dim]), in order."""
        saves = iter(moves.saved_hashes)
        for kind, blocks, srcs in moves.ops:
            t0 = time.perf_counter()
            if kind in ("save", "write"):
                hashes = next(saves)
                on_disk = self.disk is None or self.disk.has_all(hashes)  # written through already: no copy for it
                if kind == "write" and on_disk:
                    pass
                elif kind == "save" and on_disk and not self.host.int8:  # one copy, T0 block -> its slot
                    for b, s in zip(blocks, srcs):
                        self.host.data[s].copy_(kv_cache[:, :, b])
                else:
                    data = _gather(kv_cache, blocks)  # a copy no one writes again: the disk writer's
                    if kind == "save":
                        self.host.write(srcs, data)
                    if self.disk is not None:
                        self.disk.submit(hashes, data)
                if kind == "save":
                    self.host.stats.demotions += len(blocks)
                    self.host.stats.write_s += time.perf_counter() - t0
            else:
                if kind == "load" and not self.host.int8:  # one copy, slot -> T0 block
                    for b, s in zip(blocks, srcs):
                        kv_cache[:, :, b].copy_(self.host.data[s])
                else:
                    data = self.host.read(srcs) if kind == "load" else srcs
                    for i, b in enumerate(blocks):
                        kv_cache[:, :, b].copy_(data[i])
                if kind == "load":
                    self.host.stats.load_s += time.perf_counter() - t0
                else:
                    with self.disk._lock:
                        self.disk.stats.load_s += time.perf_counter() - t0

    def flush_blocks(self, hashes: list[bytes], blocks: list[int], kv_cache: torch.Tensor, timeout_s: float = 60.0) -> None:
        """Write T0 blocks straight to disk and wait (a graceful shutdown keeps what T0 cached)."""
        if self.disk is None:
            return
        todo = [(h, b) for h, b in zip(hashes, blocks) if not self.disk.contains(h)]
        for lo in range(0, len(todo), 64):
            part = todo[lo : lo + 64]
            data = _gather(kv_cache, [b for _, b in part])
            self.disk.flush(timeout_s)
            self.disk.submit([h for h, _ in part], data)
        self.disk.flush(timeout_s)

    def close(self) -> None:
        if self._reads is not None:
            self._reads.put(None)
        if self.disk is not None:
            self.disk.close()

    def describe(self) -> str:
        """For the start-up line: each tier's size."""
        parts = []
        probe = {t: f", load {s / self.block_size * 1e6:.1f} us/token" for t, s in self.probe_s_per_block.items()}
        if self.host is not None:
            h = self.host
            size = h.num_slots * h.slot_bytes + ((len(h.exact_free) + len(h.exact_of)) * h.block_bytes if h.int8 else 0)
            parts.append(f"host {size / 2**30:.2f} GiB ({h.num_slots} blocks{', int8' if h.int8 else ''}{probe.get(1, '')}"
                         f"{', read in place' if self.in_place else ''})")
        if self.disk is not None:
            parts.append(f"disk {self.disk.max_bytes / 2**30:.2f} GiB in {self.disk.dir} "
                         f"({len(self.disk)} blocks there{probe.get(2, '')})")
        return ", ".join(parts)

    def stats(self) -> dict[str, TierStats]:
        """A copy of each tier's counters."""
        out = {}
        if self.host is not None:
            out["host"] = _copy(self.host.stats)
        if self.disk is not None:
            with self.disk._lock:
                out["disk"] = _copy(self.disk.stats)
            out["disk"].prefetched = self.prefetched
        return out


def _copy(st: TierStats) -> TierStats:
    return TierStats(**{k: getattr(st, k) for k in TierStats.__slots__})
