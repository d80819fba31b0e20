"""The KV hierarchy below the engine's block pool: demote instead of drop, load instead of recompute.

Tiers (engine mechanism: they know blocks by content hash, not programs):
- T0: the engine's block pool (engine.block_pool), the only tier the model reads.
- T1 (`HostTier`): a second, larger pool of block slots in host memory (pinned beside a GPU), LRU.
- T2 (`DiskTier`): content-hashed chunk files of up to `chunk_blocks` blocks in a directory that several
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

Invariants (tests/engine/test_kv_tiers.py): every T1 slot is either free or holds exactly one hash; the
disk index maps each hash to a file that lists it; the bytes of the files indexed never exceed the bound
after a write completes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("agentrt.engine")

MAGIC = b"AGKVT2\x00\x01"
STAGED_BYTES = 256 << 20  # disk blocks read ahead and not loaded yet, at most
RESCAN_INTERVAL_S = 0.25  # a disk tier looks for other engines' new files at most this often
_HEADER_LEN = struct.Struct("<I")


@dataclass(slots=True)
class TierStats:
    """One tier's counters (cumulative unless noted)."""

    blocks: int = 0  # blocks held now
    bytes: int = 0  # bytes held now
    hits: int = 0  # blocks a prefix lookup found here (and loaded into T0)
    demotions: int = 0  # blocks written here
    evictions: int = 0  # blocks (T1) or files' blocks (T2) dropped to make room
    load_s: float = 0.0  # time spent loading blocks from here into T0
    write_s: float = 0.0  # time spent writing blocks here
    skipped: int = 0  # blocks not written: disk full, writer backlog, write error
    write_errors: int = 0  # writes that failed (the block is skipped; no call fails)
    corrupt: int = 0  # files found truncated, corrupt or foreign (never served)
    prefetched: int = 0  # blocks read ahead for a waiting call (T2)


def block_key(model_key: str, dtype: torch.dtype, block_shape: tuple[int, ...]) -> str:
    """What a stored block must match to be loaded: the model, the KV dtype and a block's shape."""
    return f"{model_key}|{dtype}|{'x'.join(map(str, block_shape))}"


class HostTier:
    """T1: `num_slots` block slots in host memory, an LRU index hash -> slot (head = next victim).

    `int8` (opt-in, lossy): a slot holds the block as int8 with a scale per (layer, K/V, head), absmax over the
    block's tokens and head dims, about half the bytes of bf16; blocks demoted with `exact` (a sequence's first
    block, the attention sink, and the last full blocks a call left: the recent window) also keep a full copy
    in a side area of `exact_slots` full blocks (least recently written dropped first), read instead."""

    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool = False,
                 store: bool = True, int8: bool = False, exact_slots: int = 0):
        if num_slots < 1:
            raise ValueError(f"the host tier needs at least one block slot, got {num_slots}")
        if int8 and len(block_shape) != 5:
            raise ValueError(f"an int8 host tier needs blocks [layers, K/V, tokens, heads, head_dim], got {block_shape}")
        # `store` False: the bookkeeping alone (the simulator's engine, bench/sim_engine.py)
        self.int8 = int8
        self.dtype = dtype
        self.data = (torch.empty((num_slots, *block_shape), dtype=torch.int8 if int8 else dtype, pin_memory=pin)
                     if store else None)
        self.num_slots = num_slots
        self.slots: OrderedDict[bytes, int] = OrderedDict()
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.block_bytes = int(torch.Size(block_shape).numel()) * dtype.itemsize
        self.slot_bytes = self.block_bytes
        if int8:
            layers, kv, _, heads, _ = block_shape
            self.scale = torch.empty((num_slots, layers, kv, 1, heads, 1), dtype=torch.float32) if store else None
            self.slot_bytes = int(torch.Size(block_shape).numel()) + layers * kv * heads * 4
            self.exact_data = torch.empty((max(1, exact_slots), *block_shape), dtype=dtype) if store else None
            self.exact_of: OrderedDict[int, int] = OrderedDict()  # slot -> its full copy in exact_data (LRU)
            self.exact_free = list(range(max(1, exact_slots) - 1, -1, -1))
            self.want_exact = [False] * num_slots  # set by `put`, for the write that follows
        self.stats = TierStats()

    @staticmethod
    def int8_slots(host_bytes: int, block_shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
        """(int8 slots, full-precision side slots) for `host_bytes`: 1/8 of the bytes for the exact copies."""
        layers, kv, _, heads, _ = block_shape
        numel = int(torch.Size(block_shape).numel())
        exact = max(1, host_bytes // 8 // (numel * dtype.itemsize))
        return max(1, (host_bytes - exact * numel * dtype.itemsize) // (numel + layers * kv * heads * 4)), exact

    def write(self, slots: list[int], data: torch.Tensor) -> None:
        """Store `data[i]` (a block, the KV dtype) in slot `slots[i]`."""
        idx = torch.tensor(slots, dtype=torch.long)
        if not self.int8:
            self.data.index_copy_(0, idx, data)
            return
        x = data.float()
        scale = x.abs().amax(dim=(3, 5), keepdim=True).clamp_min(1e-12) / 127.0
        self.data.index_copy_(0, idx, (x / scale).round_().clamp_(-127, 127).to(torch.int8))
        self.scale.index_copy_(0, idx, scale)
        for i, s in enumerate(slots):
            e = self.exact_of.pop(s, None)
            if not self.want_exact[s]:
                if e is not None:
                    self.exact_free.append(e)
                continue
            if e is None:
                if self.exact_free:
                    e = self.exact_free.pop()
                else:
                    _, e = self.exact_of.popitem(last=False)
            self.exact_data[e].copy_(data[i])
            self.exact_of[s] = e

    def read(self, slots: list[int]) -> torch.Tensor:
        """The blocks in `slots`, in the KV dtype."""
        idx = torch.tensor(slots, dtype=torch.long)
        if not self.int8:
            return self.data.index_select(0, idx)
        out = self.data.index_select(0, idx).to(self.dtype)
        out.mul_(self.scale.index_select(0, idx).to(self.dtype))
        for i, s in enumerate(slots):
            e = self.exact_of.get(s)
            if e is not None:
                out[i].copy_(self.exact_data[e])
        return out

    def get(self, h: bytes) -> int | None:
        s = self.slots.get(h)
        if s is not None:
            self.slots.move_to_end(h)
        return s

    def put(self, h: bytes, exact: bool = False, keep: bytes | None = None) -> int | None:
        """A slot for `h` (its own if it has one), evicting the least recently used entry other than `keep` (a block
        being loaded) if none is free; None if that leaves nothing to evict. `exact`: an int8 tier keeps a full
        copy too (the class docstring)."""
        s = self.slots.get(h)
        if s is not None:
            self.slots.move_to_end(h)
            return s
        if self.free:
            s = self.free.pop()
        else:
            victim = next((v for v in self.slots if v != keep), None)
            if victim is None:
                return None
            s = self.slots.pop(victim)
            self.stats.evictions += 1
        self.slots[h] = s
        if self.int8:
            self.want_exact[s] = exact
        self.stats.blocks = len(self.slots)
        self.stats.bytes = self.stats.blocks * self.slot_bytes
        return s

    def check(self) -> None:
        """The invariants (tests)."""
        used = list(self.slots.values())
        assert len(set(used)) == len(used), "a T1 slot holds two hashes"
        assert not set(used) & set(self.free), "a T1 slot is both free and used"
        assert len(used) + len(self.free) == self.num_slots, "a T1 slot is lost"


@dataclass(slots=True)
class _File:
    size: int
    hashes: list[bytes]
    crcs: list[int]
    offset: int  # of the first block's bytes


class DiskTier:
    """T2: chunk files `<dir>/<key digest>/<chunk digest>.kv` of up to `chunk_blocks` blocks, each file
    `MAGIC | header length | JSON header {key, hashes, crcs, block_bytes} | blocks`, named by a digest of its
    block hashes (the same content makes the same name on any engine); written by one background thread
    (tmp file then rename: a reader never sees half a file); `max_bytes` bounds the files indexed, least
    recently used deleted first."""

    def __init__(self, root: str | os.PathLike, max_bytes: int, key: str, block_shape: tuple[int, ...],
                 dtype: torch.dtype, chunk_blocks: int = 8, backlog: int = 64):
        if max_bytes < 1:
            raise ValueError(f"the disk tier needs a positive size, got {max_bytes} bytes")
        self.key = key
        self.dir = os.path.join(os.fspath(root), hashlib.blake2b(key.encode(), digest_size=8).hexdigest())
        os.makedirs(self.dir, exist_ok=True)
        self.max_bytes = max_bytes
        self.block_shape = block_shape
        self.dtype = dtype
        self.block_bytes = int(torch.Size(block_shape).numel()) * dtype.itemsize
        self.chunk_blocks = chunk_blocks
        self.stats = TierStats()
        self.index: dict[bytes, str] = {}  # block hash -> file name
        self.files: OrderedDict[str, _File] = OrderedDict()  # LRU: head = next to delete
        self._lock = threading.Lock()  # index, files, stats: the writer thread updates them too
        self._dir_mtime = -1.0
        self._last_rescan = -math.inf
        self._queue: queue.Queue = queue.Queue(maxsize=backlog)
        self._pending = 0  # batches queued or being written
        self._queued: set[bytes] = set()  # hashes queued or being written (each block is written once)
        self._bad: set[str] = set()  # files found bad at a scan (counted once; forgotten when they go)
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self.scan()
        self._thread = threading.Thread(target=self._write_loop, name="agentrt-kv-disk-writer", daemon=True)
        self._thread.start()

    # ---- the index -----------------------------------------------------------------------
    def scan(self) -> None:
        """Index the files in the directory not indexed yet (those another engine wrote, or an earlier run)."""
        try:
            mtime = os.stat(self.dir).st_mtime
            names = [e.name for e in os.scandir(self.dir) if e.name.endswith(".kv")]
        except OSError:
            return
        self._dir_mtime = mtime
        with self._lock:
            self._bad.intersection_update(names)
            new = [n for n in names if n not in self.files and n not in self._bad]
        for name in new:
            info = self._read_header(name)
            if info is not None:
                with self._lock:
                    self._add(name, info)
        with self._lock:
            self._evict_over(0)

    def maybe_rescan(self) -> None:
        """Rescan when the directory changed since the last scan (another engine wrote a file), at most every
        RESCAN_INTERVAL_S (this engine's own writes change it too, and a lookup misses on every step)."""
        now = time.monotonic()
        if now - self._last_rescan < RESCAN_INTERVAL_S:
            return
        self._last_rescan = now
        try:
            if os.stat(self.dir).st_mtime != self._dir_mtime:
                self.scan()
        except OSError:
            pass

    def _read_header(self, name: str) -> _File | None:
        path = os.path.join(self.dir, name)
        try:
            with open(path, "rb") as f:
                head = f.read(len(MAGIC) + _HEADER_LEN.size)
                if len(head) < len(MAGIC) + _HEADER_LEN.size or head[: len(MAGIC)] != MAGIC:
                    raise ValueError("not a KV chunk file")
                (n,) = _HEADER_LEN.unpack(head[len(MAGIC):])
                header = json.loads(f.read(n))
                size = os.fstat(f.fileno()).st_size
            hashes = [bytes.fromhex(h) for h in header["hashes"]]
            crcs = [int(c) for c in header["crcs"]]
            offset = len(MAGIC) + _HEADER_LEN.size + n
            if header["key"] != self.key or header["block_bytes"] != self.block_bytes:
                raise ValueError(f"foreign file (key {header['key']!r})")
            if len(crcs) != len(hashes) or size != offset + len(hashes) * self.block_bytes:
                raise ValueError("truncated")
            if name != _file_name(hashes):
                raise ValueError("its name is not its content's")
            return _File(size, hashes, crcs, offset)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            with self._lock:
                self.stats.corrupt += 1
                self._bad.add(name)
            logger.warning("KV disk tier: ignoring %s: %s", path, e)
            return None

    def _add(self, name: str, info: _File) -> None:  # under the lock
        old = self.files.get(name)
        self.files[name] = info
        for h in info.hashes:
            self.index[h] = name
        self.stats.bytes += info.size - (old.size if old is not None else 0)
        self.stats.blocks = len(self.index)

    def _drop(self, name: str, delete: bool) -> None:  # under the lock
        info = self.files.pop(name, None)
        if info is None:
            return
        for h in info.hashes:
            if self.index.get(h) == name:
                del self.index[h]
        if delete:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self.dir, name))
        self.stats.bytes -= info.size
        self.stats.blocks = len(self.index)

    def _evict_over(self, incoming: int) -> None:  # under the lock
        while self.files and self.stats.bytes + incoming > self.max_bytes:
            name, info = next(iter(self.files.items()))
            self.stats.evictions += len(info.hashes)
            self._drop(name, delete=True)

    def contains(self, h: bytes) -> bool:
        with self._lock:
            return h in self.index

    def has_all(self, hashes: list[bytes]) -> bool:
        """Is every block of `hashes` on disk or queued for it?"""
        with self._lock:
            return all(h in self.index or h in self._queued for h in hashes)

    def __len__(self) -> int:
        return len(self.index)

    # ---- reads (engine thread) -----------------------------------------------------------
    def read(self, h: bytes, timed: bool = True) -> torch.Tensor | None:
        """Block `h`'s data, checked against its CRC; None (and the file dropped) if missing or corrupt. `timed`:
        its time counts as load time (a read on the engine's thread; read-ahead is not)."""
        with self._lock:
            name = self.index.get(h)
            info = self.files.get(name) if name is not None else None
            if info is None:
                return None
            self.files.move_to_end(name)
        i = info.hashes.index(h)
        path = os.path.join(self.dir, name)
        t0 = time.perf_counter()
        try:
            buf = torch.empty(self.block_bytes, dtype=torch.uint8)  # read into as it is: no zero fill
            with open(path, "rb") as f:
                f.seek(info.offset + i * self.block_bytes)
                n = f.readinto(buf.numpy())
            ok = n == self.block_bytes and zlib.crc32(buf.numpy()) == info.crcs[i]
        except OSError:
            ok = False
            n = -1
        if not ok:
            with self._lock:
                self._drop(name, delete=n != -1 or os.path.exists(path))
                self.stats.corrupt += 1
            logger.warning("KV disk tier: %s is truncated or corrupt (block %d): dropped, recomputing", path, i)
            return None
        data = buf.view(self.dtype).view(self.block_shape)
        if timed:
            with self._lock:
                self.stats.load_s += time.perf_counter() - t0
        return data

    # ---- writes (writer thread) ----------------------------------------------------------
    def submit(self, hashes: list[bytes], data: torch.Tensor) -> None:
        """Queue blocks (`data[i]` is block `hashes[i]`, a tensor no one writes again) for the writer; when its
        backlog is full they are skipped and counted, never waited for."""
        with self._lock:
            if self._closed:
                return
            todo, seen = [], set()
            for i, h in enumerate(hashes):
                if h not in self.index and h not in self._queued and h not in seen:
                    seen.add(h)
                    todo.append(i)
            if not todo:
                return
            self._pending += 1
            self._queued |= seen
        try:
            self._queue.put_nowait(([hashes[i] for i in todo], data[todo] if len(todo) < len(hashes) else data))
        except queue.Full:
            with self._lock:
                self._pending -= 1
                self._queued -= seen
                self.stats.skipped += len(todo)
                self._idle.notify_all()

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until everything queued is written (or skipped); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        self.flush(timeout_s)
        with self._lock:
            self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _write_loop(self) -> None:
        _lowest_priority()  # writes wait for idle cores: a step's compute threads are never held up by them
        while True:
            item = self._queue.get()
            if item is None:
                return
            hashes, data = item
            try:
                for lo in range(0, len(hashes), self.chunk_blocks):
                    self._write_chunk(hashes[lo : lo + self.chunk_blocks], data[lo : lo + self.chunk_blocks])
            except Exception:  # never let one bad write stop the writer
                logger.exception("KV disk tier: writer failed on a batch of %d blocks", len(hashes))
            finally:
                with self._lock:
                    self._pending -= 1
                    self._queued.difference_update(hashes)
                    self._idle.notify_all()

    def _write_chunk(self, hashes: list[bytes], data: torch.Tensor) -> None:
        t0 = time.perf_counter()
        with self._lock:
            keep = [i for i, h in enumerate(hashes) if h not in self.index]
        if not keep:
            return
        hashes = [hashes[i] for i in keep]
        part = data[keep] if len(keep) < len(data) else data
        blob = memoryview(part.contiguous().view(torch.uint8).numpy()).cast("B")  # no copy: written as it is
        bb = self.block_bytes
        crcs = [zlib.crc32(blob[i * bb : (i + 1) * bb]) for i in range(len(hashes))]
        header = json.dumps({"key": self.key, "block_bytes": bb, "hashes": [h.hex() for h in hashes],
                             "crcs": crcs}).encode()
        name = _file_name(hashes)
        path = os.path.join(self.dir, name)
        size = len(MAGIC) + _HEADER_LEN.size + len(header) + len(blob)
        if size > self.max_bytes:  # would not fit even alone
            with self._lock:
                self.stats.skipped += len(hashes)
            return
        with self._lock:
            self._evict_over(size)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + _HEADER_LEN.pack(len(header)) + header)
                f.write(blob)
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            with self._lock:
                self.stats.skipped += len(hashes)
                if e.errno != errno.ENOSPC:
                    self.stats.write_errors += 1
            if e.errno == errno.ENOSPC:
                logger.warning("KV disk tier: disk full, %d blocks not demoted", len(hashes))
            else:
                logger.warning("KV disk tier: writing %s failed (%s): %d blocks not demoted", path, e, len(hashes))
            return
        with self._lock:
            self._add(name, _File(size, hashes, crcs, size - len(blob)))
            self.stats.demotions += len(hashes)
            self.stats.write_s += time.perf_counter() - t0

    def check(self) -> None:
        """The invariants (tests): each indexed hash's file lists it; the bytes indexed are within the bound."""
        with self._lock:
            for h, name in self.index.items():
                assert h in self.files[name].hashes, "the disk index names a file that does not hold the block"
            assert sum(f.size for f in self.files.values()) == self.stats.bytes, "the disk tier's byte count drifted"
            assert self.stats.bytes <= self.max_bytes, "the disk tier is over its bound"


def _gather(kv_cache: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    """Blocks of `kv_cache` ([layers, K/V, blocks, ...]) copied out, [n, layers, K/V, ...] on the CPU: one copy each."""
    out = torch.empty((len(blocks), *kv_cache.shape[:2], *kv_cache.shape[3:]), dtype=kv_cache.dtype)
    for i, b in enumerate(blocks):
        out[i].copy_(kv_cache[:, :, b])
    return out


def _lowest_priority() -> None:
    """Run the calling thread only on otherwise idle cores (Linux SCHED_IDLE; else the lowest nice value; elsewhere
    nothing)."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)


def _file_name(hashes: list[bytes]) -> str:
    return hashlib.blake2b(b"".join(hashes), digest_size=16).hexdigest() + ".kv"


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
                 host: HostTier | None = None, disk: DiskTier | None = None, prefetch: bool = True):
        """Tiers of the given sizes; or, for the simulator, the tier objects themselves (`host`, `disk`: a
        bookkeeping-only HostTier and a DiskTier stand-in) and no read-ahead thread (`prefetch` False)."""
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.block_bytes = int(torch.Size(block_shape).numel()) * dtype.itemsize
        if host is None and host_bytes and host_int8:
            slots, exact = HostTier.int8_slots(host_bytes, self.block_shape, dtype)
            host = HostTier(slots, self.block_shape, dtype, pin, int8=True, exact_slots=exact)
        elif host is None and host_bytes:
            host = HostTier(host_bytes // self.block_bytes, self.block_shape, dtype, pin)
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
        with self.disk._lock:
            self.disk.stats.hits += 1
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
        _lowest_priority()  # as the writer: a read it has not done yet, admission does itself
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
        if st.hits >= 8:
            return st.load_s / st.hits
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
            parts.append(f"host {size / 2**30:.2f} GiB ({h.num_slots} blocks{', int8' if h.int8 else ''}{probe.get(1, '')})")
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
