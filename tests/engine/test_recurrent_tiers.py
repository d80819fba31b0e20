"""Recurrent-state snapshots below the pool's in-memory LRU (engine.recurrent_tiers), exact state after each
operation: a snapshot evicted for room lands in T1 (bit for bit) and is queued for T2; a prefix lookup finds it
there, promotes it into an entry (demoting the least recently used one, never one a lookup of the same schedule
returned) and the request's slot is restored from it bit-exact; T1 full drops its least recently used; the disk
round trip survives a restart, and a corrupt or foreign file is never served. Through the engine on a tiny Qwen3.5
checkpoint with two snapshot entries: a conversation whose snapshot another one evicted resumes from T1, from T2,
and after a restart from T2, with the greedy tokens of an engine without prefix caching; every block, slot and
snapshot accounted for."""

import os
import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings

from agentrt.engine.recurrent_state import RecurrentStatePool, StateShape
from agentrt.engine.recurrent_tiers import SnapshotTiers, snapshot_key
from tests.engine.test_recurrent_state import PoolMachine, req
from tests.engine.test_recurrent_state import pool as bare_pool

SHAPE = StateShape(num_layers=2, conv_dim=3, conv_width=2, num_heads=1, key_dim=2, value_dim=2)
STATE_BYTES = SHAPE.bytes_per_state()  # 80
BS = 4


def pool(snapshots=1, host_slots=2, disk_dir=None, shape=SHAPE):
    p = RecurrentStatePool(shape, 2, snapshots, BS, "cpu")
    p.block_hashes = lambda r, n: [f"{r.tokens[: (i + 1) * BS]}".encode() for i in range(n)]
    p.tiers = SnapshotTiers(shape, snapshot_key("tiny", shape), host_bytes=host_slots * STATE_BYTES,
                            disk_dir=disk_dir, disk_bytes=1 << 20 if disk_dir is not None else 0)
    return p


def save(p, r, seed):
    """Run `r`'s whole prompt as one step; its snapshot (the last boundary) gets seeded random values. Returns
    (key, conv, ssm) of that snapshot; `r` is freed (its slot back)."""
    n = r.num_tokens - r.num_computed_tokens
    step = p.prepare([r], [n])
    ((done, entry),) = step.snapshots[0]
    g = torch.Generator().manual_seed(seed)
    p.snap_conv[:, entry] = torch.randn(p.snap_conv[:, entry].shape, generator=g)
    p.snap_ssm[:, entry] = torch.randn(p.snap_ssm[:, entry].shape, generator=g)
    p.commit(step)
    p.on_free(r)
    key = p.block_hashes(r, (r.num_computed_tokens + done) // BS)[-1]
    return key, p.snap_conv[:, entry].clone(), p.snap_ssm[:, entry].clone()


def host_state(p, key):
    """The T1 copy of snapshot `key`: (conv, ssm)."""
    return p.tiers.views(p.tiers.host.data[p.tiers.host.slots[key]])


def lookup(p, r):
    """What the KV manager asks for a request whose every full block is a KV hit: its usable prefix in tokens."""
    return p.usable_prefix(p.block_hashes(r, (r.num_tokens - 1) // BS)) * BS


def test_an_evicted_snapshot_lands_in_t1_and_a_hit_restores_it_bit_exact():
    p = pool(snapshots=1, host_slots=2)
    ka, conv_a, ssm_a = save(p, req("a", list(range(9))), seed=1)  # boundary 8
    assert list(p.snapshots.items()) == [(ka, 0)] and not p.tiers.host.slots
    kb, conv_b, ssm_b = save(p, req("b", [50] * 9), seed=2)  # its entry is a's: a goes to T1
    assert list(p.snapshots.items()) == [(kb, 0)] and list(p.tiers.host.slots.items()) == [(ka, 0)]
    got = host_state(p, ka)
    assert torch.equal(got[0], conv_a) and torch.equal(got[1], ssm_a)
    assert p.tiers.host.stats.demotions == 1
    c = req("c", list(range(8)) + [77, 78])  # shares a's 8 tokens
    without = pool(snapshots=1, host_slots=0)
    without.tiers = None
    save(without, req("a", list(range(9))), seed=1)
    save(without, req("b", [50] * 9), seed=2)
    assert lookup(without, c) == 0  # dropped, as without tiers
    assert lookup(p, c) == 8  # promoted: a back in the entry, b demoted beside it
    assert list(p.snapshots.items()) == [(ka, 0)] and p.wanted == {ka}
    assert list(p.tiers.host.slots.items()) == [(ka, 0), (kb, 1)] and p.tiers.host.stats.hits == 1
    c.num_computed_tokens = 8
    slot = p.slot(c)
    assert torch.equal(p.conv[:, slot], conv_a) and torch.equal(p.ssm[:, slot], ssm_a) and p.hits == 1
    got = host_state(p, kb)
    assert torch.equal(got[0], conv_b) and torch.equal(got[1], ssm_b)
    p.on_free(c)
    p.check()
    assert p.num_free_slots == p.num_slots


def test_a_full_t1_drops_its_least_recently_used_snapshot():
    p = pool(snapshots=1, host_slots=2)
    reqs = [req(f"r{i}", [i] * 5) for i in range(4)]
    keys = [save(p, r, seed=i)[0] for i, r in enumerate(reqs)]
    # r0, r1 and r2 were evicted in turn: T1 keeps the last two, r0 was dropped
    assert list(p.snapshots) == [keys[3]] and list(p.tiers.host.slots) == keys[1:3]
    assert (p.tiers.host.stats.demotions, p.tiers.host.stats.evictions) == (3, 1)
    assert lookup(p, req("x", [0] * 5)) == 0
    assert lookup(p, req("y", [1] * 5)) == 4  # r1 promoted (refreshed in T1); r3 demoted: r2 leaves T1, not r1
    assert list(p.snapshots) == [keys[1]] and list(p.tiers.host.slots) == [keys[1], keys[3]]
    assert p.tiers.host.stats.evictions == 2
    p.check()


def test_a_promotion_never_evicts_a_snapshot_a_lookup_of_the_same_step_returned():
    p = pool(snapshots=1, host_slots=2)
    k0 = save(p, req("r0", [0] * 5), seed=0)[0]
    k1 = save(p, req("r1", [1] * 5), seed=1)[0]  # r0 to T1
    x, y = req("x", [1] * 5), req("y", [0] * 5)
    assert lookup(p, x) == 4 and p.wanted == {k1}  # in memory
    assert lookup(p, y) == 0  # in T1, but the only entry is x's until the step takes its slot
    assert list(p.snapshots) == [k1] and list(p.tiers.host.slots) == [k0]
    x.num_computed_tokens = 4
    step = p.prepare([x], [1])  # x's slot restored: what the lookups returned is needed no more
    assert not p.wanted
    p.commit(step)
    p.on_free(x)
    assert lookup(p, y) == 4 and list(p.snapshots) == [k0] and p.wanted == {k0}
    p.check()


def test_a_resume_whose_snapshot_left_memory_after_the_lookup_is_restored_from_t1():
    p = pool(snapshots=1, host_slots=2)
    k0, conv0, ssm0 = save(p, req("r0", [0] * 5), seed=0)
    save(p, req("r1", [1] * 5), seed=1)
    r = req("r", [0] * 5, computed=4)  # resumes at r0's boundary, which is in T1 only
    slot = p.slot(r)
    assert torch.equal(p.conv[:, slot], conv0) and torch.equal(p.ssm[:, slot], ssm0)
    assert list(p.snapshots) == [k0]
    p.on_free(r)
    p.check()


def test_a_one_slot_t1_never_overwrites_the_snapshot_it_promotes():
    p = pool(snapshots=1, host_slots=1)
    k0, conv0, ssm0 = save(p, req("r0", [0] * 5), seed=0)
    k1 = save(p, req("r1", [1] * 5), seed=1)[0]  # r0 to T1's one slot
    assert lookup(p, req("x", [0] * 5)) == 4  # r1 is evicted for it, and finds no slot: dropped, r0 read intact
    assert list(p.snapshots) == [k0] and list(p.tiers.host.slots) == [k0] and k1 not in p.tiers.host.slots
    assert p.tiers.host.stats.skipped == 1
    entry = p.snapshots[k0]
    assert torch.equal(p.snap_conv[:, entry], conv0) and torch.equal(p.snap_ssm[:, entry], ssm0)
    p.check()


def test_disk_round_trip_across_a_restart_and_a_corrupt_or_foreign_file_is_refused(tmp_path):
    p = pool(snapshots=1, host_slots=0, disk_dir=tmp_path)
    assert p.tiers.host is None
    k0, conv0, ssm0 = save(p, req("r0", [0] * 5), seed=0)
    k1, conv1, ssm1 = save(p, req("r1", [1] * 5), seed=1)  # r0 evicted: queued for the disk writer
    assert p.tiers.disk.flush()
    assert p.tiers.disk.contains(k0) and not p.tiers.disk.contains(k1)
    p.flush_snapshots()  # shutdown: what memory holds goes too
    assert p.tiers.disk.contains(k1) and len(os.listdir(p.tiers.disk.dir)) == 2
    p.check()
    p.tiers.close()

    q = pool(snapshots=1, host_slots=0, disk_dir=tmp_path)  # a restarted engine: the scan finds both
    assert len(q.tiers.disk) == 2
    assert lookup(q, req("x", [0] * 5)) == 4
    r = req("r", [0] * 5, computed=4)
    step = q.prepare([r], [1])  # its slot restored from the promoted entry
    slot = step.slots[0]
    assert torch.equal(q.conv[:, slot], conv0) and torch.equal(q.ssm[:, slot], ssm0)
    q.commit(step)
    q.on_free(r)
    # a flipped byte in r1's state: the CRC refuses it, the file goes, the prefix is recomputed
    path = os.path.join(q.tiers.disk.dir, q.tiers.disk.index[k1])
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0x40]))
    assert lookup(q, req("y", [1] * 5)) == 0
    assert q.tiers.disk.stats.corrupt == 1 and not q.tiers.disk.contains(k1) and not os.path.exists(path)
    assert list(q.snapshots) == [k0] and not q.free_entries  # the entry taken for it went back; r0 kept
    q.check()
    # another state shape (same size) keeps its snapshots elsewhere, and a file of this one copied there is refused
    other = StateShape(num_layers=2, conv_dim=2, conv_width=3, num_heads=1, key_dim=2, value_dim=2)
    o = pool(snapshots=1, host_slots=0, disk_dir=tmp_path, shape=other)
    assert o.tiers.disk.dir != q.tiers.disk.dir and len(o.tiers.disk) == 0
    shutil.copy(os.path.join(q.tiers.disk.dir, q.tiers.disk.index[k0]), o.tiers.disk.dir)
    o.tiers.disk.scan()
    assert len(o.tiers.disk) == 0 and o.tiers.disk.stats.corrupt == 1
    assert lookup(o, req("z", [0] * 5)) == 0
    q.tiers.close()
    o.tiers.close()


def test_check_catches_a_t1_slot_held_twice():
    p = pool(snapshots=1, host_slots=2)
    save(p, req("r0", [0] * 5), seed=0)
    save(p, req("r1", [1] * 5), seed=1)
    p.check()
    p.tiers.host.slots[b"other"] = p.tiers.host.slots[next(iter(p.tiers.host.slots))]
    with pytest.raises(AssertionError, match="T1 slot holds two hashes"):
        p.check()


class TieredPoolMachine(PoolMachine):
    """test_recurrent_state's random requests, steps, forks, frees and resets over a pool of one entry with a
    two-slot T1 below it: a request resumes from what a lookup promoted, and its slot holds exactly its tokens'
    count; every entry and T1 slot held once."""

    def __init__(self):
        super().__init__()
        self.p = bare_pool(slots=1, snapshots=1, block_size=4, interval=8)
        self.p.tiers = SnapshotTiers(SHAPE, snapshot_key("tiny", SHAPE), host_bytes=2 * STATE_BYTES)


class TieredDiskPoolMachine(PoolMachine):
    """The same over a one-slot T1 and a disk tier (its writes land when the writer gets to them: a lookup before
    that finds less, never a wrong state)."""

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp()
        self.p = bare_pool(slots=1, snapshots=1, block_size=4, interval=8)
        self.p.tiers = SnapshotTiers(SHAPE, snapshot_key("tiny", SHAPE), host_bytes=STATE_BYTES, disk_dir=self.dir,
                                     disk_bytes=1 << 20)

    def teardown(self):
        super().teardown()
        self.p.tiers.close()
        shutil.rmtree(self.dir, ignore_errors=True)


_MACHINE = settings(max_examples=80, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestTieredPoolMachine = TieredPoolMachine.TestCase
TestTieredPoolMachine.settings = _MACHINE
TestTieredDiskPoolMachine = TieredDiskPoolMachine.TestCase
TestTieredDiskPoolMachine.settings = _MACHINE


# ---- the engine on a tiny Qwen3.5 -----------------------------------------------------------------------

HOST = {"kv_host_gib": 0.001}  # a quarter for snapshots: 11 of the tiny model's 22.5 KiB states
DISK = {"kv_disk_gib": 0.01}


@pytest.fixture(scope="module")
def qwen3_5_path(tmp_path_factory):
    from agentrt.engine.loader import load_tokenizer, resolve_model
    from tests.engine.test_qwen3_5 import make_hf, qwen3_5_config

    path = tmp_path_factory.mktemp("qwen3_5")
    make_hf(qwen3_5_config()).save_pretrained(path)
    load_tokenizer(resolve_model(os.environ.get("AGENTRT_TEST_TOKENIZER"))).save_pretrained(path)
    return path


def tokens(n, seed):
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


GREEDY_8 = dict(max_tokens=8, temperature=0, ignore_eos=True)
A1, B1 = tokens(22, 1), tokens(18, 2)  # A computes 22 + 7 tokens: snapshots at 20, 24 and 28 (block size 4)


def make_llm(path, tmp_path, tiers=(), **kw):
    from agentrt.engine import LLM

    cfg = {}
    for t in tiers:
        cfg.update(HOST if t == "host" else {**DISK, "kv_disk_dir": str(tmp_path / "kv")})
    return LLM(str(path), dtype="float32", num_blocks=64, block_size=BS, max_num_batched_tokens=64,
               recurrent_snapshots=2, **cfg, **kw)


def call(llm, prompt):
    from agentrt.engine import SamplingParams

    (o,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**GREEDY_8), progress=False)
    return o.token_ids, o.num_cached_tokens


def conversation(llm, flush=False):
    """Program A's first call, program B's (its three snapshots evict A's two from memory), A's second call:
    [(tokens, cached tokens)] of each."""
    a1 = call(llm, A1)
    b1 = call(llm, B1)
    states = llm.core.runner.states
    if flush and states.tiers is not None and states.tiers.disk is not None:
        assert states.tiers.disk.flush()  # A's evicted snapshots are on disk before they are looked up
    a2 = call(llm, A1 + a1[0] + tokens(10, 3))
    return [a1, b1, a2]


@pytest.fixture(scope="module")
def reference(qwen3_5_path, tmp_path_factory):
    """The conversation's tokens without prefix caching; and its cached tokens with two snapshot entries and no
    tiers: A's second call finds none of its own (B evicted them), so it recomputes its prompt."""
    llm = make_llm(qwen3_5_path, None, enable_prefix_caching=False)
    want = [t for t, _ in conversation(llm)]
    bare = make_llm(qwen3_5_path, None)
    got = conversation(bare)
    assert [t for t, _ in got] == want
    assert got[2][1] == 0
    return want


def assert_accounted(core):
    from tests.conftest import assert_all_blocks_free
    from tests.engine.test_qwen3_5 import assert_all_states_free

    assert_all_blocks_free(core)
    assert_all_states_free(core)  # every slot free; every snapshot entry, T1 slot and disk file held once


@pytest.mark.parametrize("tiers", [("host",), ("disk",), ("host", "disk")], ids="+".join)
def test_engine_resumes_a_conversation_from_its_demoted_snapshot(qwen3_5_path, tmp_path, reference, tiers):
    llm = make_llm(qwen3_5_path, tmp_path, tiers)
    try:
        states = llm.core.runner.states
        assert states.tiers is not None and (states.tiers.host is not None) == ("host" in tiers)
        got = conversation(llm, flush=True)
        assert [t for t, _ in got] == reference
        assert got[2][1] == 28  # A's 29 computed tokens: its last boundary, whose snapshot only a tier kept
        st = states.tiers.host.stats if "host" in tiers else states.tiers.disk.stats
        assert st.hits == 1 and st.demotions >= 2
        assert states.hits == 1
        assert_accounted(llm.core)
    finally:
        llm.close()


def test_engine_restart_resumes_the_conversation_from_disk(qwen3_5_path, tmp_path, reference):
    first = make_llm(qwen3_5_path, tmp_path, ("disk",))
    a1 = call(first, A1)
    assert a1 == (reference[0], 0)
    first.close()  # A's blocks and the snapshots in memory (at 24 and 28) go to disk
    assert len(first.core.runner.states.tiers.disk) == 3  # 20 was evicted there on the way
    second = make_llm(qwen3_5_path, tmp_path, ("disk",))
    try:
        states = second.core.runner.states
        assert len(states.tiers.disk) == 3 and not states.snapshots
        a2 = call(second, A1 + a1[0] + tokens(10, 3))
        assert a2 == (reference[2], 28)
        assert states.tiers.disk.stats.hits == 1 and second.core.kv_stats().tiers["disk"].hits == 7
        assert_accounted(second.core)
    finally:
        second.close()


def test_an_engine_refused_after_its_tiers_exist_leaves_no_writer_thread(qwen3_5_path, tmp_path):
    """A configuration refused once the KV tiers are built (a hybrid model with drafts) stops their disk writer."""
    import threading

    def writers():
        return [t for t in threading.enumerate() if t.name == "agentrt-kv-disk-writer" and t.is_alive()]

    before = len(writers())
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        make_llm(qwen3_5_path, tmp_path, ("disk",), num_speculative_tokens=2)
    for t in writers()[before:]:
        t.join(timeout=5)
    assert len(writers()) == before
