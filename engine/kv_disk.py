"""T2 of the KV hierarchy (engine.kv_tiers): content-hashed chunk files on a local disk.

A chunk file holds up to `chunk_blocks` blocks: `MAGIC | header length | JSON header {key, hashes, crcs,
block_bytes} | blocks`, named by a digest of its block hashes, so the same content makes the same name on
any engine; several engines on one host and a restarted engine share the directory (the block hash has no
seed). The header names the model, dtype and block shape and a CRC of every block, so a truncated,
corrupt or foreign file is never served. Written by one background thread (tmp file then rename: a reader
never sees half a file), bounded by bytes with the least recently used files deleted first, rescanned
for other engines' files at most every `RESCAN_INTERVAL_S`."""

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
from dataclasses import dataclass

import torch

from agentrt.engine.kv_host import TierStats

logger = logging.getLogger("agentrt.engine")

MAGIC = b"AGKVT2\x00\x01"
RESCAN_INTERVAL_S = 0.25  # a disk tier looks for other engines' new files at most this often
_HEADER_LEN = struct.Struct("<I")


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

    def count_hit(self) -> None:
        """A block (or state snapshot) read from here served a lookup (stats, which the writer thread updates too)."""
        with self._lock:
            self.stats.hits += 1

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
        lowest_priority()  # writes wait for idle cores: a step's compute threads are never held up by them
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


def lowest_priority() -> None:
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
