"""Exact-state tests of the KV hierarchy below the block pool (engine.kv_tiers): T1 host slots, T2 chunk files,
and their orchestration by `KVCacheManager` (demote on eviction, promote on a prefix lookup).

The manager tests run without a model: a fake kv_cache [layers, K/V, blocks, block_size, heads, head_dim] holds
values the test writes when it "computes" tokens, so every copy between T0, T1 and T2 can be checked exactly.
The order of a step is the engine's: schedule (lookups, allocations: moves queued), apply the moves, then the
forward writes the new tokens.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import shutil
import tempfile
import threading
import zlib

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from agentrt.engine import LLM, SamplingParams, kv_disk
from agentrt.engine.config import EngineConfig
from agentrt.engine.kv_cache_manager import KVCacheManager
from agentrt.engine.kv_disk import MAGIC, DiskTier
from agentrt.engine.kv_host import HostTier, block_key
from agentrt.engine.kv_tiers import KVTiers
from agentrt.engine.request import Request
from tests.conftest import assert_all_blocks_free
from tests.engine.test_kv_retention import check

# ---- helpers ---------------------------------------------------------------------------------------------

BS = 4
L, H, D = 2, 1, 2
SHAPE = (L, 2, BS, H, D)  # one block of the fake cache
BLOCK_BYTES = L * 2 * BS * H * D * 4  # float32

DSHAPE = (2, 2, 4, 1, 8)  # the disk tier's unit tests: a bf16 block of 256 bytes
DBYTES = 2 * 2 * 4 * 1 * 8 * 2
DKEY = block_key("tiny-test", torch.bfloat16, DSHAPE)


def hs(*ids: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in ids]


def rand_blocks(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *DSHAPE, generator=g).to(torch.bfloat16)


def kv_files(d: str) -> list[str]:
    return sorted(os.listdir(d))


def bump_mtime(d: str) -> None:
    """Make a directory's change visible whatever the file system's mtime granularity."""
    st = os.stat(d)
    os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))


@pytest.fixture
def disks(tmp_path):
    """DiskTier factory; every tier made is closed (its writer stopped) at the end."""
    made: list[DiskTier] = []

    def make(root=None, max_bytes: int = 1 << 20, key: str = DKEY, chunk_blocks: int = 2, backlog: int = 64):
        t = DiskTier(tmp_path if root is None else root, max_bytes, key, DSHAPE, torch.bfloat16,
                     chunk_blocks=chunk_blocks, backlog=backlog)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def make_tiers(host_slots: int = 0, disk_dir=None, disk_bytes: int = 1 << 20) -> KVTiers:
    return KVTiers(SHAPE, torch.float32, "fake-model", host_bytes=host_slots * BLOCK_BYTES,
                   disk_dir=None if disk_dir is None else str(disk_dir), disk_bytes=disk_bytes)


def make_req(rid: str, tokens, max_tokens: int = 16) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def fake_cache(num_blocks: int) -> torch.Tensor:
    """Distinct values in every block."""
    return torch.arange(L * 2 * num_blocks * BS * H * D, dtype=torch.float32).view(L, 2, num_blocks, BS, H, D)


def block(kv_cache: torch.Tensor, b: int) -> torch.Tensor:
    return kv_cache[:, :, b].clone()


def apply_moves(kv: KVCacheManager, kv_cache: torch.Tensor):
    """What the engine does between scheduling and the forward; the moves applied."""
    moves = kv.take_tier_moves()
    if moves:
        kv.tiers.apply(moves, kv_cache)
    return moves


def ops_of(moves) -> list[tuple[str, list[int], list]]:
    """The moves' ops, disk reads ("put") shown as None."""
    return [(k, list(b), [None if isinstance(s, torch.Tensor) else s for s in src]) for k, b, src in moves.ops]


def admit(kv: KVCacheManager, kv_cache: torch.Tensor, req: Request, fill: float | None = None):
    """Admit `req` with its cached prefix, apply the moves, 'compute' the rest (each new block filled with
    `fill + its index`; None: the blocks keep what they hold), cache its full blocks. Returns (hits, moves)."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits)
    moves = apply_moves(kv, kv_cache)
    for i, b in enumerate(req.block_ids[len(hits):]):
        if fill is not None:
            kv_cache[:, :, b] = fill + i
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    kv.admitted(req, num_hit)
    return hits, moves


A = list(range(9))  # 2 full blocks + 1 token
B = list(range(50, 63))  # 3 full blocks + 1 token


# ---- T1: HostTier ----------------------------------------------------------------------------------------


def test_host_tier_lru_put_get_and_eviction():
    t = HostTier(3, DSHAPE, torch.bfloat16)
    h0, h1, h2, h3 = hs(0, 1, 2, 3)
    assert [t.put(h0), t.put(h1), t.put(h2)] == [0, 1, 2]
    assert t.free == [] and t.stats.evictions == 0
    assert (t.stats.blocks, t.stats.bytes) == (3, 3 * DBYTES)
    assert t.get(h0) == 0  # h0 becomes the most recently used
    assert t.get(h3) is None
    assert list(t.slots) == [h1, h2, h0]
    assert t.put(h3) == 1  # evicts h1, the least recently used, and takes its slot
    assert list(t.slots.items()) == [(h2, 2), (h0, 0), (h3, 1)]
    assert t.get(h1) is None
    assert (t.stats.blocks, t.stats.bytes, t.stats.evictions) == (3, 3 * DBYTES, 1)
    assert t.put(h2) == 2  # already there: its own slot, refreshed, nothing evicted
    assert list(t.slots) == [h0, h3, h2] and t.stats.evictions == 1
    t.check()


def test_host_tier_check_catches_a_broken_slot_table():
    t = HostTier(2, DSHAPE, torch.bfloat16)
    t.put(hs(0)[0])
    t.check()
    t.free.append(0)  # slot 0 both free and used
    with pytest.raises(AssertionError, match="both free and used"):
        t.check()
    t.free.remove(0)
    t.slots[hs(9)[0]] = 0  # slot 0 holds two hashes
    with pytest.raises(AssertionError, match="two hashes"):
        t.check()


def test_host_tier_needs_a_slot():
    with pytest.raises(ValueError, match="at least one block slot, got 0"):
        HostTier(0, DSHAPE, torch.bfloat16)
    with pytest.raises(ValueError, match="at least one block slot, got 0"):
        KVTiers(SHAPE, torch.float32, "k", host_bytes=BLOCK_BYTES - 1)  # asked for, but less than a block
    t = KVTiers(SHAPE, torch.float32, "k", host_bytes=3 * BLOCK_BYTES + BLOCK_BYTES - 1)
    assert t.host.num_slots == 3 and t.disk is None


# ---- T2: DiskTier ----------------------------------------------------------------------------------------


def read_file(path: str) -> tuple[dict, bytes, int]:
    """(header, payload, header's end) of a chunk file."""
    with open(path, "rb") as f:
        raw = f.read()
    assert raw[: len(MAGIC)] == MAGIC
    n = int.from_bytes(raw[len(MAGIC) : len(MAGIC) + 4], "little")
    start = len(MAGIC) + 4
    return json.loads(raw[start : start + n]), raw[start + n :], start + n


def test_disk_tier_writes_chunks_indexes_every_hash_and_reads_back_exactly(disks):
    t = disks(chunk_blocks=2)
    hashes, data = hs(0, 1, 2, 3, 4), rand_blocks(5)
    t.submit(hashes, data)
    assert t.flush()
    chunks = [hashes[0:2], hashes[2:4], hashes[4:5]]
    names = [kv_disk._file_name(c) for c in chunks]
    assert kv_files(t.dir) == sorted(names)
    assert t.index == {h: names[i // 2] for i, h in enumerate(hashes)}
    assert list(t.files) == names  # written in order: the first chunk is the least recently used
    total = 0
    for name, chunk in zip(names, chunks):
        path = os.path.join(t.dir, name)
        header, payload, end = read_file(path)
        lo = hashes.index(chunk[0])
        blocks = [data[i].view(torch.uint8).numpy().tobytes() for i in range(lo, lo + len(chunk))]
        assert header == {"key": DKEY, "block_bytes": DBYTES, "hashes": [h.hex() for h in chunk],
                          "crcs": [zlib.crc32(b) for b in blocks]}
        assert payload == b"".join(blocks)
        info = t.files[name]
        assert (info.size, info.offset, info.hashes) == (os.path.getsize(path), end, chunk)
        total += info.size
    assert (t.stats.blocks, t.stats.bytes, t.stats.demotions, t.stats.skipped, t.stats.corrupt) == (5, total, 5, 0, 0)
    for i, h in enumerate(hashes):
        got = t.read(h)
        assert got.dtype == torch.bfloat16 and got.shape == DSHAPE and torch.equal(got, data[i])
    assert t.read(hs(9)[0]) is None
    assert t.contains(hashes[3]) and not t.contains(hs(9)[0]) and len(t) == 5
    t.check()


def test_disk_tier_submit_skips_what_it_has(disks):
    t = disks(chunk_blocks=8)
    data = rand_blocks(3)
    t.submit(hs(0, 1), data[:2])
    t.flush()
    t.submit(hs(1, 2), data[1:])  # hash 1 is on disk already: only block 2 is written
    t.flush()
    assert kv_files(t.dir) == sorted([kv_disk._file_name(hs(0, 1)), kv_disk._file_name(hs(2))])
    assert t.stats.demotions == 3 and len(t) == 3
    assert torch.equal(t.read(hs(2)[0]), data[2])


def test_disk_tier_bound_evicts_least_recently_used_files(disks):
    t = disks(max_bytes=900, chunk_blocks=1)  # a one-block file is ~380 bytes: two fit, three do not
    data = rand_blocks(3)
    h0, h1, h2 = hs(0, 1, 2)
    for i, h in enumerate((h0, h1)):
        t.submit([h], data[i : i + 1])
        t.flush()
    n0, n1, n2 = (kv_disk._file_name([h]) for h in (h0, h1, h2))
    assert list(t.files) == [n0, n1] and t.stats.evictions == 0
    assert torch.equal(t.read(h0), data[0])  # h0's file becomes the most recently used
    assert list(t.files) == [n1, n0]
    t.submit([h2], data[2:])
    t.flush()
    assert list(t.files) == [n0, n2]
    assert kv_files(t.dir) == sorted([n0, n2])  # h1's file deleted
    assert set(t.index) == {h0, h2}
    assert t.read(h1) is None
    assert t.stats.evictions == 1 and t.stats.blocks == 2
    assert t.stats.bytes == sum(os.path.getsize(os.path.join(t.dir, n)) for n in (n0, n2)) <= 900
    t.check()


def test_disk_tier_skips_a_chunk_larger_than_its_bound(disks):
    """A file that would not fit even alone is not written (it would leave the tier over its bound)."""
    t = disks(max_bytes=500, chunk_blocks=2)  # a one-block file is ~380 bytes, a two-block one ~680
    t.submit(hs(0, 1), rand_blocks(2))
    t.flush()
    assert (t.stats.skipped, t.stats.demotions, t.stats.bytes) == (2, 0, 0)
    assert t.index == {} and kv_files(t.dir) == []
    t.submit(hs(2), rand_blocks(1))  # one block fits
    t.flush()
    assert set(t.index) == set(hs(2)) and t.stats.demotions == 1 and t.stats.bytes <= 500
    t.check()


def test_disk_tier_truncated_file_is_detected_on_read(disks):
    t = disks(chunk_blocks=2)
    data = rand_blocks(2)
    t.submit(hs(0, 1), data)
    t.flush()
    name = kv_disk._file_name(hs(0, 1))
    path = os.path.join(t.dir, name)
    os.truncate(path, os.path.getsize(path) - 1)  # the last block loses a byte
    assert t.read(hs(1)[0]) is None
    assert t.stats.corrupt == 1
    assert t.index == {} and name not in t.files and not os.path.exists(path)
    assert t.read(hs(0)[0]) is None  # the whole file is dropped with its first block
    assert t.stats.corrupt == 1 and t.stats.blocks == 0 and t.stats.bytes == 0
    t.check()


def test_disk_tier_flipped_payload_byte_is_detected_on_read(disks):
    t = disks(chunk_blocks=2)
    data = rand_blocks(2)
    t.submit(hs(0, 1), data)
    t.flush()
    name = kv_disk._file_name(hs(0, 1))
    path = os.path.join(t.dir, name)
    _, _, end = read_file(path)
    with open(path, "r+b") as f:
        f.seek(end + DBYTES + 7)  # a byte of block 1
        byte = f.read(1)
        f.seek(end + DBYTES + 7)
        f.write(bytes([byte[0] ^ 0x10]))
    assert os.path.getsize(path) == t.files[name].size  # same size: only the CRC tells
    assert t.read(hs(1)[0]) is None
    assert t.stats.corrupt == 1 and t.index == {} and not os.path.exists(path)


def test_disk_tier_ignores_foreign_and_truncated_files_at_scan(disks, tmp_path):
    other = disks(root=tmp_path / "other", key=block_key("another-model", torch.bfloat16, DSHAPE))
    other.submit(hs(0), rand_blocks(1))
    other.flush()
    t = disks(root=tmp_path / "mine")
    name = kv_disk._file_name(hs(0))
    shutil.copy(os.path.join(other.dir, name), os.path.join(t.dir, name))  # same name, foreign key header
    t.scan()
    assert t.stats.corrupt == 1
    assert t.index == {} and t.files == {} and not t.contains(hs(0)[0]) and t.read(hs(0)[0]) is None
    # a truncated file an earlier run left: never indexed by a restarted tier
    t.submit(hs(1), rand_blocks(1, seed=1))
    t.flush()
    path = os.path.join(t.dir, kv_disk._file_name(hs(1)))
    os.truncate(path, os.path.getsize(path) - 3)
    t2 = disks(root=tmp_path / "mine")
    assert t2.stats.corrupt == 2  # the foreign file and the truncated one
    assert t2.index == {} and t2.stats.blocks == 0
    # a file renamed: its name is not its content's
    ok = os.path.join(other.dir, name)
    os.rename(ok, os.path.join(other.dir, kv_disk._file_name(hs(7))))
    other3 = disks(root=tmp_path / "other", key=block_key("another-model", torch.bfloat16, DSHAPE))
    assert other3.stats.corrupt == 1 and other3.index == {}


def test_disk_tier_counts_a_bad_file_once(disks, tmp_path):
    """A file ignored at a scan is not read (and counted) again at every rescan; the tier's own writes change
    the directory, so `maybe_rescan` rescans often."""
    other = disks(root=tmp_path / "other", key=block_key("another-model", torch.bfloat16, DSHAPE))
    other.submit(hs(0), rand_blocks(1))
    other.flush()
    t = disks(root=tmp_path / "mine")
    name = kv_disk._file_name(hs(0))
    shutil.copy(os.path.join(other.dir, name), os.path.join(t.dir, name))
    t.scan()
    t.submit(hs(1), rand_blocks(1))
    t.flush()
    bump_mtime(t.dir)
    t.maybe_rescan()
    t.scan()
    assert t.stats.corrupt == 1 and set(t.index) == set(hs(1))


class _FailingWrites:
    """An open file whose writes fail with `err` (after the file exists: the tmp file must be removed)."""

    def __init__(self, f, err: int):
        self.f, self.err = f, err

    def write(self, _):
        raise OSError(self.err, os.strerror(self.err))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def fail_writes(monkeypatch, err: int) -> None:
    real_open = open

    def fake_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return _FailingWrites(f, err) if "w" in mode else f

    monkeypatch.setattr(kv_disk, "open", fake_open, raising=False)


def test_disk_full_skips_blocks_without_errors(disks, monkeypatch):
    t = disks(chunk_blocks=2)
    fail_writes(monkeypatch, errno.ENOSPC)
    t.submit(hs(0, 1, 2), rand_blocks(3))  # two chunks, both hit a full disk
    assert t.flush()
    assert (t.stats.skipped, t.stats.write_errors, t.stats.demotions) == (3, 0, 0)
    assert t.index == {} and t.files == {} and t.stats.bytes == 0
    assert kv_files(t.dir) == []  # no tmp file left behind
    monkeypatch.undo()
    t.submit(hs(0), rand_blocks(1))  # space again: the writer still runs
    t.flush()
    assert t.stats.demotions == 1 and set(t.index) == set(hs(0))


def test_disk_write_error_is_counted_and_skipped(disks, monkeypatch):
    t = disks(chunk_blocks=2)
    fail_writes(monkeypatch, errno.EIO)
    t.submit(hs(0, 1, 2), rand_blocks(3))
    assert t.flush()
    assert (t.stats.skipped, t.stats.write_errors, t.stats.demotions) == (3, 2, 0)  # one error per chunk
    assert t.index == {} and kv_files(t.dir) == []


def test_disk_writer_backlog_full_skips_never_waits(disks, monkeypatch):
    t = disks(chunk_blocks=8, backlog=1)
    entered, go = threading.Event(), threading.Event()
    real_open = open

    def slow_open(path, mode="r", *args, **kwargs):
        if "w" in mode:
            entered.set()
            assert go.wait(10)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(kv_disk, "open", slow_open, raising=False)
    data = rand_blocks(4)
    t.submit(hs(0), data[0:1])  # taken by the writer, which blocks
    assert entered.wait(10)
    t.submit(hs(1), data[1:2])  # queued (backlog 1)
    t.submit(hs(2, 3), data[2:4])  # the queue is full: skipped at once
    assert t.stats.skipped == 2
    go.set()
    assert t.flush()
    assert set(t.index) == set(hs(0, 1)) and t.stats.demotions == 2 and t.stats.skipped == 2


def test_disk_tier_restart_indexes_the_old_files(disks, tmp_path):
    t1 = disks(chunk_blocks=2)
    hashes, data = hs(0, 1, 2, 3, 4), rand_blocks(5)
    t1.submit(hashes, data)
    t1.close()
    t2 = disks()
    assert t2.dir == t1.dir
    assert t2.index == t1.index and set(t2.files) == set(t1.files)
    assert (t2.stats.blocks, t2.stats.bytes, t2.stats.corrupt) == (5, t1.stats.bytes, 0)
    for i, h in enumerate(hashes):
        assert torch.equal(t2.read(h), data[i])
    other_key = disks(key=block_key("tiny-test", torch.float16, DSHAPE))  # another dtype: another directory
    assert other_key.dir != t1.dir and len(other_key) == 0


def test_two_disk_tiers_share_a_directory(tmp_path):
    t1 = make_tiers(disk_dir=tmp_path)
    t2 = make_tiers(disk_dir=tmp_path)
    try:
        h = hs(5)[0]
        data = torch.arange(BLOCK_BYTES // 4, dtype=torch.float32).view(1, *SHAPE)
        assert t2.lookup(h) is None
        t1.disk.submit([h], data)
        t1.disk.flush()
        assert not t2.disk.contains(h)  # not rescanned yet
        bump_mtime(t2.disk.dir)
        assert t2.lookup(h) is None  # within RESCAN_INTERVAL_S of the last rescan: not looked for yet
        t2.disk._last_rescan -= kv_disk.RESCAN_INTERVAL_S
        assert t2.lookup(h) == (2, None)  # the lookup miss rescans the changed directory
        assert torch.equal(t2.disk.read(h), data[0])
        assert t2.disk.stats.corrupt == 0 and t2.disk.stats.demotions == 0
    finally:
        t1.close()
        t2.close()


# ---- KVCacheManager with tiers (no model) ----------------------------------------------------------------


def test_demote_on_eviction_then_promote_from_host():
    tiers = make_tiers(host_slots=3)
    kv = KVCacheManager(4, BS, tiers=tiers)
    kv_cache = fake_cache(4)
    a = make_req("a", A)
    hits, moves = admit(kv, kv_cache, a)
    assert a.block_ids == [0, 1, 2] and hits == [] and not moves
    data_a = {0: block(kv_cache, 0), 1: block(kv_cache, 1)}
    hA = kv.block_hashes(a, 2)
    kv.free(a)
    assert list(kv.pool.free_queue) == [2, 3, 1, 0]

    b = make_req("b", B)
    hits, moves = admit(kv, kv_cache, b, fill=-100.0)
    assert hits == [] and b.block_ids == [2, 3, 1, 0]
    assert ops_of(moves) == [("save", [1, 0], [0, 1])]  # A's tail evicted (demoted) before its head
    assert moves.saved_hashes == [[hA[1], hA[0]]]
    assert list(tiers.host.slots.items()) == [(hA[1], 0), (hA[0], 1)]
    assert torch.equal(tiers.host.data[0], data_a[1]) and torch.equal(tiers.host.data[1], data_a[0])
    assert kv.stats.evictions == 2
    hB = kv.block_hashes(b, 3)
    assert kv.pool.cached == {hB[0]: 2, hB[1]: 3, hB[2]: 1}
    data_b2 = block(kv_cache, 1)
    kv.free(b)
    assert list(kv.pool.free_queue) == [0, 1, 3, 2]

    a2 = make_req("a2", A)
    hits, num_hit = kv.get_computed_blocks(a2)
    assert (hits, num_hit) == ([0, 1], 8)
    moves = kv.take_tier_moves()
    # hA0 loads into the free block 0; hA1's block (1) evicts B's tail hB2 first: saved before it is overwritten
    assert ops_of(moves) == [("load", [0], [1]), ("save", [1], [2]), ("load", [1], [0])]
    assert moves.saved_hashes == [[hB[2]]]
    assert kv.pool.cached == {hA[0]: 0, hA[1]: 1, hB[0]: 2, hB[1]: 3}
    assert list(kv.pool.free_queue) == [3, 2, 1, 0]  # the promoted chain at the tail, its tail first
    # each lookup refreshes its hash before the allocation demotes hB2
    assert list(tiers.host.slots.items()) == [(hA[0], 1), (hA[1], 0), (hB[2], 2)]
    tiers.apply(moves, kv_cache)
    assert torch.equal(block(kv_cache, 0), data_a[0]) and torch.equal(block(kv_cache, 1), data_a[1])
    assert torch.equal(tiers.host.data[2], data_b2)
    assert (tiers.host.stats.hits, tiers.host.stats.demotions, tiers.host.stats.evictions) == (2, 3, 0)
    assert kv.stats.evictions == 3

    assert kv.allocate_slots(a2, 1, hits)
    assert a2.block_ids == [0, 1, 3]
    moves = apply_moves(kv, kv_cache)  # block 3 (hB1) evicted: T1 is full, its LRU entry hA0 goes
    assert ops_of(moves) == [("save", [3], [1])]
    assert list(tiers.host.slots.items()) == [(hA[1], 0), (hB[2], 2), (hB[1], 1)]
    assert tiers.host.stats.evictions == 1
    kv.admitted(a2, num_hit)
    assert (kv.stats.queries_tokens, kv.stats.hit_tokens) == (9 + 13 + 9, 8)
    tiers.host.check()
    check(kv, [a2])
    kv.free(a2)
    assert kv.num_free_blocks == 4


def test_write_through_then_promote_from_disk_only(tmp_path):
    tiers = make_tiers(disk_dir=tmp_path)
    try:
        kv = KVCacheManager(4, BS, tiers=tiers)
        kv_cache = fake_cache(4)
        a = make_req("a", A)
        _, moves = admit(kv, kv_cache, a)
        assert not moves
        data_a = {0: block(kv_cache, 0), 1: block(kv_cache, 1)}
        hA = kv.block_hashes(a, 2)
        moves = kv.take_tier_moves()  # the next step's: A's newly cached blocks written through to disk
        assert ops_of(moves) == [("write", [0, 1], [None, None])] and moves.saved_hashes == [hA]
        tiers.apply(moves, kv_cache)
        assert tiers.disk.flush()
        name = kv_disk._file_name(hA)
        assert kv_files(tiers.disk.dir) == [name]
        assert tiers.disk.index == {hA[0]: name, hA[1]: name}
        assert torch.equal(tiers.disk.read(hA[0]), data_a[0]) and torch.equal(tiers.disk.read(hA[1]), data_a[1])
        kv.free(a)

        b = make_req("b", B)
        _, moves = admit(kv, kv_cache, b, fill=-100.0)
        assert not moves and kv.stats.evictions == 2  # A's blocks are on disk already: nothing to demote
        hB = kv.block_hashes(b, 3)
        moves = kv.take_tier_moves()
        assert ops_of(moves) == [("write", [2, 3, 1], [None] * 3)] and moves.saved_hashes == [hB]
        tiers.apply(moves, kv_cache)
        assert tiers.disk.flush()
        kv.free(b)
        assert list(kv.pool.free_queue) == [0, 1, 3, 2]

        a2 = make_req("a2", A)
        hits, num_hit = kv.get_computed_blocks(a2)
        assert (hits, num_hit) == ([0, 1], 8)
        moves = kv.take_tier_moves()
        assert ops_of(moves) == [("put", [0, 1], [None, None])]  # read and checked now, copied at apply
        assert kv.stats.evictions == 3  # hB2's block reused for hA1 (hB2 is on disk)
        tiers.apply(moves, kv_cache)
        assert torch.equal(block(kv_cache, 0), data_a[0]) and torch.equal(block(kv_cache, 1), data_a[1])
        assert kv.pool.cached == {hA[0]: 0, hA[1]: 1, hB[0]: 2, hB[1]: 3}
        st = tiers.stats()["disk"]
        assert (st.hits, st.demotions, st.blocks, st.corrupt, st.skipped) == (2, 5, 5, 0, 0)
        assert kv.allocate_slots(a2, 1, hits)
        kv.admitted(a2, num_hit)
        assert (kv.stats.queries_tokens, kv.stats.hit_tokens) == (9 + 13 + 9, 8)
        tiers.disk.check()
        check(kv, [a2])
        kv.free(a2)
        assert kv.num_free_blocks == 4
    finally:
        tiers.close()


def test_a_block_evicted_right_after_it_was_cached_is_written_once(tmp_path):
    """Cached (write-through queued) then evicted before the next apply (demote queues it again): one copy on
    disk, not two in the same chunk file."""
    tiers = make_tiers(disk_dir=tmp_path)
    try:
        kv = KVCacheManager(4, BS, tiers=tiers)
        kv_cache = fake_cache(4)
        a = make_req("a", A)
        admit(kv, kv_cache, a)
        data_a = [block(kv_cache, 0), block(kv_cache, 1)]
        hA = kv.block_hashes(a, 2)
        kv.free(a)
        b = make_req("b", B)
        _, moves = admit(kv, kv_cache, b, fill=-100.0)  # the engine's next step: A's write-through not applied yet
        assert ops_of(moves) == [("write", [0, 1, 1, 0], [None] * 4)]
        assert moves.saved_hashes == [[hA[0], hA[1], hA[1], hA[0]]]
        assert tiers.disk.flush()
        name = kv_disk._file_name(hA)
        assert kv_files(tiers.disk.dir) == [name]
        header, _, _ = read_file(os.path.join(tiers.disk.dir, name))
        assert header["hashes"] == [h.hex() for h in hA]
        assert (tiers.disk.stats.demotions, tiers.disk.stats.blocks, tiers.disk.stats.skipped) == (2, 2, 0)
        assert torch.equal(tiers.disk.read(hA[0]), data_a[0]) and torch.equal(tiers.disk.read(hA[1]), data_a[1])
    finally:
        tiers.close()


def test_demote_to_host_and_disk_then_promote_from_host(tmp_path):
    tiers = make_tiers(host_slots=3, disk_dir=tmp_path)
    try:
        kv = KVCacheManager(4, BS, tiers=tiers)
        kv_cache = fake_cache(4)
        a = make_req("a", A)
        admit(kv, kv_cache, a)
        data_a = {0: block(kv_cache, 0), 1: block(kv_cache, 1)}
        hA = kv.block_hashes(a, 2)
        kv.free(a)
        b = make_req("b", B)
        _, moves = admit(kv, kv_cache, b, fill=-100.0)
        # A's write-through (queued when it was cached), then its eviction to T1, tail first
        assert ops_of(moves) == [("write", [0, 1], [None, None]), ("save", [1, 0], [0, 1])]
        assert moves.saved_hashes == [hA, [hA[1], hA[0]]]
        assert tiers.disk.flush()
        assert kv_files(tiers.disk.dir) == [kv_disk._file_name(hA)]  # the T1 copies were on disk already
        assert torch.equal(tiers.disk.read(hA[1]), data_a[1])
        assert torch.equal(tiers.host.data[0], data_a[1]) and torch.equal(tiers.host.data[1], data_a[0])
        kv.free(b)
        a2 = make_req("a2", A)
        hits, _ = kv.get_computed_blocks(a2)
        assert hits == [0, 1]
        moves = kv.take_tier_moves()
        # from T1 (a memory copy), not T2; hB2's eviction saves it to T1 (it is on disk already)
        assert [(k, blocks) for k, blocks, _ in moves.ops] == [("write", [2, 3, 1]), ("load", [0]), ("save", [1]),
                                                                ("load", [1])]
        tiers.apply(moves, kv_cache)
        assert torch.equal(block(kv_cache, 0), data_a[0]) and torch.equal(block(kv_cache, 1), data_a[1])
        assert tiers.disk.flush()
        st = tiers.stats()
        assert (st["host"].hits, st["host"].demotions, st["disk"].hits, st["disk"].demotions) == (2, 3, 0, 5)
        tiers.host.check()
        tiers.disk.check()
    finally:
        tiers.close()


def test_tail_blocks_are_demoted_before_head_blocks():
    """A freed (or preempted) request releases its tail first: its tail leaves T0 first and its head stays a
    T0 hit; a later lookup takes the head from T0 and the tail from T1."""
    tiers = make_tiers(host_slots=4)
    kv = KVCacheManager(6, BS, tiers=tiers)
    kv_cache = fake_cache(6)
    a = make_req("a", range(17))  # 4 full blocks + 1 token
    admit(kv, kv_cache, a)
    data_a = [block(kv_cache, b) for b in range(4)]
    hA = kv.block_hashes(a, 4)
    kv.free(a, retain=False)
    assert list(kv.pool.free_queue) == [4, 5, 3, 2, 1, 0]
    c = make_req("c", range(60, 72))  # 3 blocks: the two never-cached ones, then A's tail
    _, moves = admit(kv, kv_cache, c, fill=-1.0)
    assert c.block_ids == [4, 5, 3]
    assert ops_of(moves) == [("save", [3], [0])] and moves.saved_hashes == [[hA[3]]]
    kv.free(c)
    d = make_req("d", range(80, 84))  # 1 block: the next victim is A's block 2
    _, moves = admit(kv, kv_cache, d, fill=-2.0)
    assert d.block_ids == [2] and ops_of(moves) == [("save", [2], [1])] and moves.saved_hashes == [[hA[2]]]
    assert kv.pool.cached.get(hA[0]) == 0 and kv.pool.cached.get(hA[1]) == 1  # the head is still in T0
    a2 = make_req("a2", range(17))
    hits, num_hit = kv.get_computed_blocks(a2)
    assert num_hit == 16 and hits[:2] == [0, 1]
    moves = apply_moves(kv, kv_cache)
    assert [k for k, _, _ in moves.ops] == ["save", "load", "save", "load"]  # each load's block saved first
    for i, b in enumerate(hits):
        assert kv.pool.block_hash[b] == hA[i] and torch.equal(block(kv_cache, b), data_a[i])
    assert tiers.host.stats.hits == 2
    tiers.host.check()


def test_promote_stops_when_loading_costs_more_than_recomputing():
    tiers = make_tiers(host_slots=4)
    kv = KVCacheManager(4, BS, tiers=tiers)
    kv_cache = fake_cache(4)
    a = make_req("a", A)
    admit(kv, kv_cache, a)
    kv.free(a)
    b = make_req("b", B)
    admit(kv, kv_cache, b, fill=-1.0)  # evicts A to T1
    kv.free(b)
    assert len(tiers.host.slots) == 2 and kv.num_free_blocks == 4
    tiers.host.stats.hits, tiers.host.stats.load_s = 8, 8e-2  # measured over 8 loads: 10 ms a block
    tiers.recompute_s_per_token = 1e-3  # 4 ms a block of 4 tokens
    assert not tiers.worth_loading(1)
    before = list(kv.pool.free_queue)
    assert kv.get_computed_blocks(make_req("a2", A)) == ([], 0)
    assert not kv.take_tier_moves() and list(kv.pool.free_queue) == before and tiers.host.stats.hits == 8
    tiers.recompute_s_per_token = 1e-2  # 40 ms a block: loading wins
    assert tiers.worth_loading(1)
    assert kv.get_computed_blocks(make_req("a3", A))[1] == 8


def test_corrupt_disk_block_is_recomputed_not_served(tmp_path):
    tiers = make_tiers(disk_dir=tmp_path)
    try:
        kv = KVCacheManager(4, BS, tiers=tiers)
        kv_cache = fake_cache(4)
        a = make_req("a", A)
        admit(kv, kv_cache, a)
        hA = kv.block_hashes(a, 2)
        tiers.apply(kv.take_tier_moves(), kv_cache)
        tiers.disk.flush()
        kv.free(a)
        b = make_req("b", B)
        admit(kv, kv_cache, b, fill=-1.0)  # evicts A's blocks (on disk)
        kv.free(b)
        path = os.path.join(tiers.disk.dir, kv_disk._file_name(hA))
        _, _, end = read_file(path)
        with open(path, "r+b") as f:  # flip a byte of hA0's block
            f.seek(end + 3)
            byte = f.read(1)
            f.seek(end + 3)
            f.write(bytes([byte[0] ^ 1]))
        before = list(kv.pool.free_queue)
        hits, num_hit = kv.get_computed_blocks(make_req("a2", A))
        assert (hits, num_hit) == ([], 0)
        moves = kv.take_tier_moves()
        assert [k for k, _, _ in moves.ops] == ["write"]  # B's write-through only: nothing loaded
        assert list(kv.pool.free_queue) == before  # the block taken for the load went back where it was
        assert tiers.disk.stats.corrupt == 1 and not tiers.disk.contains(hA[0]) and not tiers.disk.contains(hA[1])
        assert not os.path.exists(path) and tiers.disk.stats.hits == 0
    finally:
        tiers.close()


def test_one_slot_host_tier_never_loads_the_wrong_data():
    """The block a promotion evicts from T0 must not take the T1 slot being loaded (with one slot, the LRU
    victim would be that very slot: the load would copy the evicted block's data in). It is not kept instead."""
    tiers = make_tiers(host_slots=1)
    kv = KVCacheManager(2, BS, tiers=tiers)
    kv_cache = fake_cache(2)
    a = make_req("a", range(5))  # 1 full block + 1 token: blocks [0, 1]
    admit(kv, kv_cache, a)
    data_a0 = block(kv_cache, 0)
    hA0 = kv.block_hashes(a, 1)[0]
    kv.free(a)
    b = make_req("b", range(40, 48))  # 2 full blocks: evicts hA0 to the T1 slot
    admit(kv, kv_cache, b, fill=-1.0)
    hB = kv.block_hashes(b, 2)
    assert list(tiers.host.slots) == [hA0] and torch.equal(tiers.host.data[0], data_a0)
    kv.free(b)
    assert list(kv.pool.free_queue) == [0, 1]  # hB1's block is the next victim
    hits, num_hit = kv.get_computed_blocks(make_req("a2", range(5)))
    assert (hits, num_hit) == ([0], 4)
    moves = apply_moves(kv, kv_cache)
    assert ops_of(moves) == [("load", [0], [0])]  # hB1 not saved: the only slot is being read
    assert kv.pool.cached == {hA0: 0, hB[0]: 1}
    assert torch.equal(block(kv_cache, 0), data_a0)
    assert list(tiers.host.slots) == [hA0]
    assert (tiers.host.stats.skipped, tiers.host.stats.evictions, tiers.host.stats.hits) == (1, 0, 1)
    tiers.host.check()


def test_prefetch_reads_disk_blocks_ahead(tmp_path):
    tiers = make_tiers(disk_dir=tmp_path)
    try:
        kv = KVCacheManager(4, BS, tiers=tiers)
        kv_cache = fake_cache(4)
        a = make_req("a", A)
        admit(kv, kv_cache, a)
        data_a = [block(kv_cache, 0), block(kv_cache, 1)]
        tiers.apply(kv.take_tier_moves(), kv_cache)
        tiers.disk.flush()
        kv.free(a)
        b = make_req("b", B)
        admit(kv, kv_cache, b, fill=-1.0)
        kv.free(b)
        a2 = make_req("a2", A)
        kv.prefetch(a2)
        for _ in range(500):
            if tiers.prefetched == 2:
                break
            threading.Event().wait(0.01)
        assert tiers.prefetched == 2
        hits, num_hit = kv.get_computed_blocks(a2)
        assert num_hit == 8 and tiers.prefetch_used == 2
        apply_moves(kv, kv_cache)
        assert [torch.equal(block(kv_cache, b), d) for b, d in zip(hits, data_a)] == [True, True]
        assert tiers.stats()["disk"].prefetched == 2
    finally:
        tiers.close()


# ---- property: demote / promote never mixes up data -------------------------------------------------------

NB = 6
PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9],
    [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23, 24],
    [1, 2, 3, 4, 30, 31, 32, 33, 34, 35, 36, 37, 38],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
    [40, 41, 42, 43, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63],
]


@functools.cache
def token_kv(prefix: tuple[int, ...]) -> torch.Tensor:
    """A token's K and V ([L, 2, H, D]): a function of the whole prefix up to it, as a model's are."""
    v = int.from_bytes(hashlib.blake2b(repr(prefix).encode(), digest_size=2).digest(), "little")
    return (v * 16 + torch.arange(L * 2 * H * D, dtype=torch.float32)).view(L, 2, H, D)


@functools.cache
def expected_block(prefix: tuple[int, ...]) -> torch.Tensor:
    """The content of the full block ending `prefix`: [L, 2, BS, H, D]."""
    n = len(prefix)
    return torch.stack([token_kv(prefix[: n - BS + s + 1]) for s in range(BS)], dim=2)


class TierMachine(RuleBasedStateMachine):
    """Requests from prompts with shared prefixes admitted, computed in chunks, decoded, preempted and freed on a
    pool of 6 blocks over small tiers, the moves applied after each operation (the engine's order: schedule,
    apply, forward). Invariants: the pool's, T1's and T2's, and every cached block in T0, every T1 slot and
    every disk block holds exactly the content of its hash."""

    HOST_SLOTS = 3
    DISK = False

    def __init__(self):
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="kvtiers-") if self.DISK else None
        self.tiers = make_tiers(self.HOST_SLOTS, self.tmp, disk_bytes=3000)
        self.kv = KVCacheManager(NB, BS, tiers=self.tiers)
        self.kv_cache = torch.full((L, 2, NB, BS, H, D), -1.0)
        self.live: list[Request] = []
        self.prefix_of: dict[bytes, tuple[int, ...]] = {}
        self.ids = 0

    def sync(self) -> None:
        moves = self.kv.take_tier_moves()
        if moves:
            self.tiers.apply(moves, self.kv_cache)
        assert self.kv.take_pending_copies() == []

    def compute(self, req: Request, n: int) -> None:
        """The forward: write the K/V of tokens [computed, computed + n), then cache the full blocks."""
        ids = req.all_token_ids
        for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
            self.kv_cache[:, :, req.block_ids[p // BS], p % BS] = token_kv(tuple(ids[: p + 1]))
        req.num_computed_tokens += n
        self.kv.cache_blocks(req)
        for i in range(req.num_cached_blocks):
            self.prefix_of[req.block_hashes[i]] = tuple(ids[: (i + 1) * BS])

    @rule(prompt=st.sampled_from(PROMPTS), tail=st.lists(st.integers(0, 3), max_size=5), chunk=st.integers(1, 12))
    def add(self, prompt, tail, chunk):
        if len(self.live) >= 3:
            return
        self.ids += 1
        req = make_req(f"r{self.ids}", prompt + tail)
        hits, num_hit = self.kv.get_computed_blocks(req)
        hashes = self.kv.block_hashes(req, len(hits))
        assert [self.kv.pool.block_hash[b] for b in hits] == hashes
        assert all(h in self.prefix_of for h in hashes)  # only what was computed is ever found
        n = min(chunk, req.num_tokens - num_hit)
        ok = self.kv.allocate_slots(req, n, hits)
        self.sync()
        if ok:
            req.num_computed_tokens = num_hit
            self.kv.admitted(req, num_hit)
            self.compute(req, n)
            self.live.append(req)

    @rule(prompt=st.sampled_from(PROMPTS), tail=st.lists(st.integers(0, 3), max_size=5))
    def run_whole_call(self, prompt, tail):
        """A call admitted, computed in one step and finished: its blocks cached, then left to the LRU."""
        self.ids += 1
        req = make_req(f"r{self.ids}", prompt + tail)
        hits, num_hit = self.kv.get_computed_blocks(req)
        ok = self.kv.allocate_slots(req, req.num_tokens - num_hit, hits)
        self.sync()
        if ok:
            req.num_computed_tokens = num_hit
            self.kv.admitted(req, num_hit)
            self.compute(req, req.num_tokens - num_hit)
            self.kv.free(req)

    @rule(i=st.integers(0, 2), chunk=st.integers(1, 8), token=st.integers(0, 3))
    def advance(self, i, chunk, token):
        if not self.live:
            return
        req = self.live[i % len(self.live)]
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(token)  # a decode step
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        ok = self.kv.allocate_slots(req, n)
        self.sync()
        if ok:
            self.compute(req, n)
        else:  # preempted: its blocks go back tail first
            self.kv.free(req, retain=False)
            self.live.remove(req)

    @rule(i=st.integers(0, 2))
    def finish(self, i):
        if self.live:
            self.kv.free(self.live.pop(i % len(self.live)))

    @rule()
    def reset_prefix_cache(self):
        self.kv.reset_prefix_cache()

    @invariant()
    def content_matches_hash(self):
        # what is still pending is the write-through of the blocks just cached: the engine applies it at the
        # next step, after that step's scheduling queued more (left pending here too)
        assert all(kind == "write" for kind, _, _ in self.tiers._moves.ops)
        check(self.kv, self.live)
        pool = self.kv.pool
        for b, h in enumerate(pool.block_hash):
            if h is not None:
                assert torch.equal(self.kv_cache[:, :, b], expected_block(self.prefix_of[h])), f"T0 block {b}"
        host = self.tiers.host
        if host is not None:
            host.check()
            for h, s in host.slots.items():
                assert torch.equal(host.data[s], expected_block(self.prefix_of[h])), f"T1 slot {s}"
        disk = self.tiers.disk
        if disk is not None:
            assert disk.flush()
            disk.check()
            for h in list(disk.index):
                assert torch.equal(disk.read(h), expected_block(self.prefix_of[h])), "T2 block"
            assert disk.stats.corrupt == 0 and disk.stats.skipped == 0

    def teardown(self):
        try:
            for r in self.live:
                self.kv.free(r)
            self.sync()
            assert self.kv.num_free_blocks == NB
            check(self.kv)
        finally:
            self.tiers.close()
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)


class HostOnlyMachine(TierMachine):
    HOST_SLOTS = 3


class HostOneSlotMachine(TierMachine):
    HOST_SLOTS = 1  # the LRU victim of a demotion can be the slot being loaded


class HostAndDiskMachine(TierMachine):
    HOST_SLOTS = 2
    DISK = True


class DiskOnlyMachine(TierMachine):
    HOST_SLOTS = 0
    DISK = True


_PROPERTY = settings(max_examples=100, stateful_step_count=30, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestHostOnly = HostOnlyMachine.TestCase
TestHostOnly.settings = _PROPERTY
TestHostOneSlot = HostOneSlotMachine.TestCase
TestHostOneSlot.settings = _PROPERTY
TestHostAndDisk = HostAndDiskMachine.TestCase
TestHostAndDisk.settings = _PROPERTY
TestDiskOnly = DiskOnlyMachine.TestCase
TestDiskOnly.settings = _PROPERTY


# ---- the engine on the tiny model ------------------------------------------------------------------------

EBS = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0)
# 50 tokens each: 3 full blocks + 2; under 64 tokens a step, so no recompute cost is measured and every block
# found below T0 is loaded (KVTiers.worth_loading)
ENGINE_PROMPTS = [[1000 * (i + 1) + 3 * j for j in range(50)] for i in range(5)]
TIER_CONFIGS = {
    "off": {},
    "host": {"kv_host_gib": 0.0005},  # 65 blocks of 8 KiB
    "disk": {"kv_disk_gib": 0.01},
    "host+disk": {"kv_host_gib": 0.0005, "kv_disk_gib": 0.01},
}


def tiny_llm(path, tmp_path, tiers: str, **kw) -> LLM:
    cfg = dict(TIER_CONFIGS[tiers])
    if "kv_disk_gib" in cfg:
        cfg["kv_disk_dir"] = str(tmp_path / "kv")
    return LLM(str(path), device="cpu", dtype="float32", num_blocks=12, block_size=EBS, **cfg, **kw)


def run_calls(llm: LLM) -> list[list[int]]:
    """Five calls one after another (12 blocks: the first ones are evicted), then the first two again."""
    outs = [llm.generate([p], GREEDY, progress=False)[0].token_ids for p in ENGINE_PROMPTS]
    if llm.core.tiers is not None and llm.core.tiers.disk is not None:
        assert llm.core.tiers.disk.flush()  # the evicted blocks are on disk before they are looked up
    return outs + [llm.generate([p], GREEDY, progress=False)[0].token_ids for p in ENGINE_PROMPTS[:2]]


@pytest.fixture(scope="module")
def outputs_without_tiers(tiny_model_path, tmp_path_factory):
    llm = tiny_llm(tiny_model_path, tmp_path_factory.mktemp("off"), "off")
    outs = run_calls(llm)
    s = llm.core.kv_stats()
    assert (s.prefix_hit_tokens, s.evictions, s.tiers) == (0, 10, {})  # the repeated calls were evicted
    assert_all_blocks_free(llm.core)
    return outs


@pytest.mark.parametrize("tiers", ["host", "disk", "host+disk"])
def test_engine_same_greedy_tokens_with_tiers_and_hits_below_t0(tiny_model_path, tmp_path, outputs_without_tiers,
                                                                 tiers):
    llm = tiny_llm(tiny_model_path, tmp_path, tiers)
    try:
        assert run_calls(llm) == outputs_without_tiers
        s = llm.core.kv_stats()
        assert s.prefix_hit_tokens == 2 * 3 * EBS  # both repeated calls: their 3 full prompt blocks
        assert s.evictions == 10
        host, disk = s.tiers.get("host"), s.tiers.get("disk")
        if host is not None:
            # every eviction demoted to T1 (no block evicted twice); the repeats' 6 blocks loaded from there
            assert (host.hits, host.demotions, host.blocks, host.evictions) == (6, 10, 10, 0)
        if disk is not None:
            assert disk.hits == (0 if host is not None else 6)
            assert (disk.corrupt, disk.skipped, disk.write_errors) == (0, 0, 0)
        assert_all_blocks_free(llm.core)
    finally:
        llm.close()


def test_engine_restart_serves_the_prompt_from_disk(tiny_model_path, tmp_path, outputs_without_tiers):
    first = tiny_llm(tiny_model_path, tmp_path, "disk")
    out = first.generate([ENGINE_PROMPTS[0]], GREEDY, progress=False)[0].token_ids
    assert out == outputs_without_tiers[0]
    first.close()  # writes what T0 holds: the prompt's 3 full blocks (50 + 7 computed tokens)
    assert first.core.tiers.disk.stats.blocks == 3
    second = tiny_llm(tiny_model_path, tmp_path, "disk")
    try:
        assert second.core.kv_stats().tiers["disk"].blocks == 3  # found by the scan at start
        out = second.generate([ENGINE_PROMPTS[0]], GREEDY, progress=False)[0].token_ids
        assert out == outputs_without_tiers[0]
        s = second.core.kv_stats()
        assert s.prefix_hit_tokens == 3 * EBS
        assert s.tiers["disk"].hits == 3
        assert_all_blocks_free(second.core)
    finally:
        second.close()


def test_engine_kv_stats_tiers_is_a_snapshot(tiny_model_path, tmp_path):
    llm = tiny_llm(tiny_model_path, tmp_path, "host+disk")
    try:
        before = llm.core.kv_stats().tiers
        run_calls(llm)
        assert before["host"].hits == 0 and before["host"].demotions == 0 and before["disk"].demotions == 0
        after = llm.core.kv_stats().tiers
        assert (after["host"].hits, after["host"].demotions) == (6, 10)
    finally:
        llm.close()


def test_engine_one_slot_host_tier_same_greedy_tokens(tiny_model_path, tmp_path):
    """A one-slot T1 (kv_host_gib under two blocks) where the promotion of a call's block evicts a cached block
    from T0: the tokens are those without tiers."""
    a, b, c = ([base + 3 * j for j in range(n)] for base, n in ((1000, 20), (5000, 32), (9000, 32)))
    one, eight = SamplingParams(max_tokens=1, temperature=0), SamplingParams(max_tokens=8, temperature=0)
    outs = {}
    for name, cfg in (("off", {}), ("one slot", {"kv_host_gib": 1e-5})):
        llm = LLM(str(tiny_model_path), device="cpu", dtype="float32", num_blocks=4, block_size=EBS, **cfg)
        try:
            for p in (a, b, c):  # b and c fill the pool with cached blocks; c evicts a's block to T1
                llm.generate([p], one, progress=False)
            outs[name] = llm.generate([a], eight, progress=False)[0].token_ids
            s = llm.core.kv_stats()
            if cfg:
                assert llm.core.tiers.host.num_slots == 1
                assert s.prefix_hit_tokens == EBS
                host = s.tiers["host"]
                assert (host.hits, host.skipped) == (1, 1)  # the block evicted for the load was not kept
            assert_all_blocks_free(llm.core)
        finally:
            llm.close()
    assert outs["one slot"] == outs["off"]


@pytest.mark.parametrize(("kw", "message"), [
    ({"kv_disk_gib": 1.0}, r"kv_disk_gib \(1\.0\) sizes the disk tier: give kv_disk_dir too"),
    ({"kv_host_gib": -1.0}, r"kv_host_gib must be a number of GiB >= 0, got -1\.0"),
    ({"kv_host_gib": float("nan")}, r"kv_host_gib must be a number of GiB >= 0, got nan"),
    ({"kv_host_gib": True}, r"kv_host_gib must be a number of GiB >= 0, got True"),
    ({"kv_disk_dir": "/tmp/x", "kv_disk_gib": 0}, r"kv_disk_gib must be a number of GiB > 0, got 0"),
    ({"kv_disk_dir": ""}, r"kv_disk_dir must be a directory path, got ''"),
    ({"kv_host_gib": 1.0, "enable_prefix_caching": False}, r"kv_host_gib, kv_disk_dir.*need.*enable_prefix_caching"),
    ({"kv_disk_dir": "/tmp/x", "enable_prefix_caching": False}, r"need.*enable_prefix_caching"),
])
def test_tier_config_errors_name_the_bad_value(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(device="cpu", **kw)


def test_tier_config_accepts_the_tiers():
    c = EngineConfig(device="cpu", kv_host_gib=0.5, kv_disk_dir="/tmp/x", kv_disk_gib=2)
    assert (c.kv_host_gib, c.kv_disk_dir, c.kv_disk_gib) == (0.5, "/tmp/x", 2)
    assert EngineConfig(device="cpu", kv_disk_dir="/tmp/x").kv_disk_gib is None  # 8 GiB by default


# ---- the default model -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_same_greedy_tokens_with_tiers(default_model_path, tmp_path):
    """Multi-block prompts through an 8-block cache: the repeated one comes back from T1, not recomputed, and
    the tokens are those of the engine without tiers."""
    from agentrt.engine.loader import load_tokenizer

    tok = load_tokenizer(default_model_path)
    topics = ["the history of tea", "how bridges carry loads", "why the sky is blue", "what makes bread rise"]
    # 50 tokens: 3 full blocks + 2, under 64 tokens a step (no recompute cost measured: every block found is loaded)
    prompts = [tok(f"Write one short paragraph about {t}. Be precise, concrete and brief, use plain words that "
                   f"anyone can follow, give one example from daily life, compare it with one from history, and "
                   f"end with a question for the reader to think about afterwards.")["input_ids"][:50] for t in topics]
    assert all(len(p) == 50 for p in prompts)
    params = SamplingParams(max_tokens=6, temperature=0)
    outs, stats = {}, {}
    for tiers in ("off", "host+disk"):
        cfg = {} if tiers == "off" else {"kv_host_gib": 0.02, "kv_disk_dir": str(tmp_path / "kv"), "kv_disk_gib": 0.1}
        llm = LLM(str(default_model_path), device="cpu", dtype="float32", num_blocks=8, block_size=EBS, **cfg)
        try:
            outs[tiers] = [llm.generate([p], params, progress=False)[0].token_ids for p in prompts + prompts[:1]]
            stats[tiers] = llm.core.kv_stats()
            assert_all_blocks_free(llm.core)
        finally:
            llm.close()
    assert outs["host+disk"] == outs["off"]
    full = (len(prompts[0]) - 1) // EBS * EBS
    assert stats["off"].prefix_hit_tokens == 0
    assert stats["host+disk"].prefix_hit_tokens == full
    assert stats["host+disk"].tiers["host"].hits == full // EBS
