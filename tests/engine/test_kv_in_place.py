"""Exact-state tests of in-place reads of the host KV tier (engine.kv_tiers, "In-place reads"): on a CPU engine
T1's slots are the tail of the KV tensor, a prefix hit's T1 blocks are named where they lie (block id
`num_blocks + slot`) instead of copied, the slot is held while a table names it, and only a hit's first block
and its last `HOT_BLOCKS` are still copied into T0.

The manager tests run without a model, on test_kv_tiers.py's fake cache (here T0 + T1 blocks in one tensor).
"""

from __future__ import annotations

import argparse

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from agentrt._cli_options import add_engine_options, add_kv_tier_options, engine_options, kv_tier_options
from agentrt.engine import LLM, SamplingParams
from agentrt.engine.config import EngineConfig
from agentrt.engine.kv_cache_manager import HOT_BLOCKS, KVCacheManager
from agentrt.engine.kv_host import HostTier
from agentrt.engine.kv_layout import KVGroup, KVLayout
from agentrt.engine.kv_tiers import KVTiers
from tests.conftest import assert_all_blocks_free
from tests.engine.test_kv_retention import check
from tests.engine.test_kv_tiers import (
    _PROPERTY,
    BLOCK_BYTES,
    BS,
    D,
    DSHAPE,
    NB,
    PROMPTS,
    SHAPE,
    H,
    L,
    TierMachine,
    admit,
    apply_moves,
    block,
    expected_block,
    fake_cache,
    hs,
    make_req,
    ops_of,
)

T0, T1 = 8, 10


def in_place_manager(t0: int = T0, t1: int = T1, **kw) -> tuple[KVCacheManager, KVTiers, torch.Tensor]:
    """A KV manager over T0 blocks whose T1 of `t1` slots is blocks t0... of the same fake cache."""
    tiers = KVTiers(SHAPE, torch.float32, "fake-model", host_bytes=t1 * BLOCK_BYTES, in_place=True)
    kv = KVCacheManager(t0, BS, tiers=tiers, **kw)
    kv_cache = fake_cache(t0 + t1)
    tiers.attach(kv_cache, t0)
    return kv, tiers, kv_cache


P = list(range(100, 125))  # 6 full blocks + 1 token
Q = list(range(200, 229))  # 7 full blocks + 1 token: needs all 8 T0 blocks


def demote_p(kv: KVCacheManager, kv_cache: torch.Tensor) -> tuple[list[bytes], list[torch.Tensor]]:
    """P computed and freed, then Q, which evicts P's 6 cached blocks into T1 (tail first: slot s holds P's
    block 5 - s). Returns P's block hashes and contents."""
    p = make_req("p", P)
    admit(kv, kv_cache, p)
    hashes = kv.block_hashes(p, 6)
    data = [block(kv_cache, b) for b in p.block_ids[:6]]
    kv.free(p)
    q = make_req("q", Q)
    admit(kv, kv_cache, q, fill=-100.0)
    kv.free(q)
    assert list(kv.tiers.host.slots.items()) == [(hashes[5 - s], s) for s in range(6)]
    return hashes, data


# ---- HostTier: held slots ---------------------------------------------------------------------------------


def test_host_tier_never_evicts_a_slot_a_table_reads():
    t = HostTier(3, DSHAPE, torch.bfloat16)
    h0, h1, h2, h3, h4 = hs(0, 1, 2, 3, 4)
    assert [t.put(h0), t.put(h1), t.put(h2)] == [0, 1, 2]
    t.hold(0, True)  # h0, the least recently used, is read in place
    assert t.put(h3) == 1  # h1 goes instead
    assert list(t.slots.items()) == [(h0, 0), (h2, 2), (h3, 1)] and t.stats.evictions == 1
    t.hold(2, True)
    t.hold(1, True)
    assert t.put(h4) is None  # every slot held: nothing to evict
    assert list(t.slots.items()) == [(h0, 0), (h2, 2), (h3, 1)] and t.stats.evictions == 1
    t.check()
    t.hold(0, False)
    assert t.put(h4) == 0 and t.in_use == {1, 2}
    t.check()


def test_host_tier_share_checks_the_view():
    t = HostTier(2, SHAPE, torch.float32, store=False)
    with pytest.raises(ValueError, match=r"must be 2 blocks of \(2, 2, 4, 1, 2\) in torch.float32, got \(3, 2, 2, 4, 1, 2\)"):
        t.share(torch.zeros(3, *SHAPE))
    with pytest.raises(ValueError, match="int8 host tier cannot share"):
        HostTier(2, SHAPE, torch.float32, store=False, int8=True).share(torch.zeros(2, *SHAPE))
    tiers = KVTiers(SHAPE, torch.float32, "k", host_bytes=2 * BLOCK_BYTES, in_place=True)
    assert tiers.host.data is None  # no memory of its own
    with pytest.raises(ValueError, match=r"has no 2 blocks of .* from block 3"):
        tiers.attach(fake_cache(4), 3)
    cache = fake_cache(5)
    tiers.attach(cache, 3)
    assert tiers.in_place_base == 3 and torch.equal(tiers.host.data[1], cache[:, :, 4])
    tiers.host.data[0].fill_(7.0)  # a view: a slot written is the tensor's block
    assert bool((cache[:, :, 3] == 7.0).all())
    with pytest.raises(ValueError, match="in-place reads need an exact host tier"):
        KVTiers(SHAPE, torch.float32, "k", host_bytes=2 * BLOCK_BYTES, host_int8=True, in_place=True)


# ---- KVCacheManager with in-place reads (no model) --------------------------------------------------------


def test_t1_hit_is_read_in_place_and_held_until_the_request_ends():
    kv, tiers, kv_cache = in_place_manager()
    hashes, data = demote_p(kv, kv_cache)
    host = tiers.host
    assert (host.stats.hits, host.stats.in_place, host.stats.demotions) == (0, 0, 6)

    p2 = make_req("p2", P)
    hits, num_hit = kv.get_computed_blocks(p2)
    assert num_hit == 6 * BS and HOT_BLOCKS == 2
    # block 0 (the sink, the program's head) and the last two copied into T0; blocks 1-3 named where they lie
    # (P's block i is in slot 5 - i: block id T0 + 5 - i)
    assert hits[1:4] == [T0 + 4, T0 + 3, T0 + 2] and all(b < T0 for b in hits[:1] + hits[4:])
    moves = kv.take_tier_moves()
    loads = [(b, s) for kind, bs_, ss in ops_of(moves) if kind == "load" for b, s in zip(bs_, ss)]
    assert loads == [(hits[0], 5), (hits[4], 1), (hits[5], 0)]  # no copy of slots 2-4
    # the first copy took Q's partial block (no hash), the next two Q's cached blocks 6 and 5 (saved to slots 6, 7)
    assert [kind for kind, _, _ in moves.ops] == ["load", "save", "load", "save", "load"]
    assert (host.stats.hits, host.stats.in_place, p2.num_tier_loaded_tokens) == (3, 0, 3 * BS)  # the copies
    tiers.apply(moves, kv_cache)
    for i, b in enumerate(hits):
        assert torch.equal(block(kv_cache, b), data[i]), f"block {i} (id {b})"
    assert host.in_use == set()  # found, not yet held: the table takes them at admission
    # a waiting request looks its prefix up again at the next step: the same hits, nothing copied or counted again
    assert kv.get_computed_blocks(p2) == (hits, num_hit) and not kv.take_tier_moves()
    assert (host.stats.hits, host.stats.in_place, p2.num_tier_loaded_tokens) == (3, 0, 3 * BS)

    assert kv.allocate_slots(p2, 1, hits)
    assert (host.stats.hits, host.stats.in_place, p2.num_tier_loaded_tokens) == (6, 3, 6 * BS)  # taken: counted
    assert p2.block_ids[:6] == hits and len(p2.block_ids) == 7 and p2.block_ids[6] < T0
    assert host.in_use == {2, 3, 4}
    assert [kv.pool.ref_cnt[T0 + s] for s in range(T1)] == [0, 0, 1, 1, 1, 0, 0, 0, 0, 0]
    apply_moves(kv, kv_cache)
    p2.num_computed_tokens = p2.num_tokens
    kv.cache_blocks(p2)  # in-place ids are not registered in T0
    assert [kv.pool.cached.get(h) for h in hashes] == [hits[0], None, None, None, hits[4], hits[5]]
    assert set(kv.pool.cached.values()) <= set(range(T0))
    kv.admitted(p2, num_hit)
    check(kv, [p2])
    host.check()

    # pressure: r's 3 blocks evict Q's cached blocks 3, 2, 1 from T0 into T1, which holds 9 then 10 blocks and
    # then must evict: its LRU order is P's blocks 0..5 (refreshed by the lookups), then Q's; P's block 0 (slot
    # 5) goes, then blocks 1-3 are skipped (held) and block 4 (slot 1) goes
    r = make_req("r", list(range(300, 309)))
    before = {s: host.data[s].clone() for s in (2, 3, 4)}
    admit(kv, kv_cache, r, fill=-300.0)
    assert host.stats.evictions == 2 and hashes[0] not in host.slots and hashes[4] not in host.slots
    for s in (2, 3, 4):
        assert host.slots.get(hashes[5 - s]) == s and torch.equal(host.data[s], before[s])
    host.check()

    kv.free(p2)  # finished: the slots are released, still cached in T1, evictable
    assert host.in_use == set() and all(r == 0 for r in kv.pool.ref_cnt[T0:])
    assert {host.slots[hashes[i]] for i in (1, 2, 3)} == {2, 3, 4}
    kv.free(r)
    check(kv)
    assert kv.num_free_blocks == T0 and all(x == 0 for x in kv.pool.ref_cnt)
    host.check()


@pytest.mark.parametrize("path", ["finish", "preempt", "abort", "ttl pin"])
def test_every_free_path_releases_the_in_place_slots(path):
    kv, tiers, kv_cache = in_place_manager()
    demote_p(kv, kv_cache)
    owner = None
    if path == "ttl pin":
        from agentrt.engine.program_ops import Pin, StartProgram

        owner = "prog"
        kv.program_op(StartProgram(owner), 0.0)
        kv.program_op(Pin(owner, 60.0), 0.0)
    p2 = make_req("p2", P)
    p2.program_id = owner
    hits, num_hit = kv.get_computed_blocks(p2)
    assert kv.allocate_slots(p2, 1, hits)
    assert tiers.host.in_use == {2, 3, 4}
    apply_moves(kv, kv_cache)
    kv.free(p2, retain=path in ("finish", "ttl pin"))  # the scheduler's preempt and abort free without retention
    assert tiers.host.in_use == set() and all(r == 0 for r in kv.pool.ref_cnt[T0:])
    pinned = [b for o in kv.owners.values() for b in o.pin]
    if path == "ttl pin":  # the call's T0 blocks pinned for its program; a T1 slot is not T0 room: not pinned
        assert sorted(pinned) == sorted(b for b in hits if b < T0) and kv.num_pinned_blocks == 3
    else:
        assert pinned == []
    check(kv)


def test_a_fork_shares_the_in_place_slots_until_both_end():
    kv, tiers, kv_cache = in_place_manager()
    demote_p(kv, kv_cache)
    parent = make_req("parent", P)
    hits, _ = kv.get_computed_blocks(parent)
    assert kv.allocate_slots(parent, 1, hits)
    parent.num_computed_tokens = parent.num_tokens
    child = make_req("parent#1", P)
    kv.fork(parent, child)
    assert [kv.pool.ref_cnt[T0 + s] for s in (2, 3, 4)] == [2, 2, 2]
    assert kv.allocate_slots(child, 1)  # its first write: a copy of the shared partial block, never a T1 slot
    assert child.block_ids[:6] == hits and child.block_ids[6] != parent.block_ids[6]
    kv.free(parent)
    assert tiers.host.in_use == {2, 3, 4}
    check(kv, [child])
    kv.free(child)
    assert tiers.host.in_use == set()
    check(kv)


def test_a_short_hit_is_copied_whole():
    """A hit of HOT_BLOCKS + 1 blocks has no block between its first and its recent window: all copied."""
    kv, tiers, kv_cache = in_place_manager()
    demote_p(kv, kv_cache)
    req = make_req("short", P[:13])  # 3 full blocks + 1
    hits, num_hit = kv.get_computed_blocks(req)
    assert num_hit == 3 * BS and all(b < T0 for b in hits)
    assert tiers.host.stats.in_place == 0 and tiers.host.stats.hits == 3


def test_in_place_needs_one_full_attention_group():
    tiers = KVTiers(SHAPE, torch.float32, "k", host_bytes=2 * BLOCK_BYTES, in_place=True)
    layout = KVLayout((KVGroup(None, (1,)), KVGroup(8, (0,))), 1, 2)
    with pytest.raises(ValueError, match=r"one full-attention layer group, got 2 group\(s\) with windows \[None, 8\]"):
        KVCacheManager(T0, BS, tiers=tiers, layout=layout)


# ---- property: in-place reads never mix up data or leak a slot -------------------------------------------

# test_kv_tiers' prompts and two of 6 full blocks + 1 (sharing 4 blocks), drawn as often as all of those
LONG = [*PROMPTS, *[list(range(1, 26)), [*range(1, 18), 70, 71, 72, 73, 74, 75, 76, 77, 78]] * 3]


class InPlaceMachine(TierMachine):
    """test_kv_tiers.TierMachine with T1 read in place, over prompts long enough for a hit to have blocks
    between its first and its recent window. Also: every in-place id a live table names holds its block's
    content and is held in T1; no other slot is."""

    HOST_SLOTS = 6

    def __init__(self):
        super().__init__()
        self.tiers = KVTiers(SHAPE, torch.float32, "fake-model", host_bytes=self.HOST_SLOTS * BLOCK_BYTES, in_place=True)
        self.kv = KVCacheManager(NB, BS, tiers=self.tiers)
        self.kv_cache = torch.full((L, 2, NB + self.HOST_SLOTS, BS, H, D), -1.0)
        self.tiers.attach(self.kv_cache, NB)

    @rule(prompt=st.sampled_from(LONG), tail=st.lists(st.integers(0, 3), max_size=5), chunk=st.integers(1, 12))
    def add(self, prompt, tail, chunk):
        if len(self.live) >= 3:
            return
        self.ids += 1
        req = make_req(f"r{self.ids}", prompt + tail)
        hits, num_hit = self.kv.get_computed_blocks(req)
        hashes = self.kv.block_hashes(req, len(hits))
        host = self.tiers.host
        for b, h in zip(hits, hashes):
            assert (self.kv.pool.block_hash[b] if b < NB else next(k for k, s in host.slots.items() if s == b - NB)) == h
        n = min(chunk, req.num_tokens - num_hit)
        ok = self.kv.allocate_slots(req, n, hits)
        self.sync()
        if ok:
            req.num_computed_tokens = num_hit
            self.kv.admitted(req, num_hit)
            self.compute(req, n)
            self.live.append(req)

    @rule(prompt=st.sampled_from(LONG), tail=st.lists(st.integers(0, 3), max_size=5))
    def run_whole_call(self, prompt, tail):
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

    @invariant()
    def in_place_ids_hold_their_blocks(self):
        host, held = self.tiers.host, set()
        for r in self.live:
            for i, b in enumerate(r.block_ids):
                if b >= NB:
                    assert i < r.num_cached_blocks and (r.num_computed_tokens >= (i + 1) * BS)
                    assert torch.equal(self.kv_cache[:, :, b], expected_block(tuple(r.all_token_ids[: (i + 1) * BS])))
                    held.add(b - NB)
        assert host.in_use == held


TestInPlace = InPlaceMachine.TestCase
TestInPlace.settings = _PROPERTY


# ---- config and command line ------------------------------------------------------------------------------


@pytest.mark.parametrize(("kw", "message"), [
    ({"kv_host_in_place": True}, r"kv_host_in_place reads the host tier's blocks where they lie: give kv_host_gib"),
    ({"kv_host_in_place": True, "kv_host_gib": 1.0, "kv_host_quantization": "int8"},
     r"kv_host_in_place needs an exact host tier.*kv_host_quantization='int8'"),
    ({"kv_host_in_place": "yes", "kv_host_gib": 1.0}, r"kv_host_in_place must be true, false or None .*got 'yes'"),
])
def test_in_place_config_errors_name_the_bad_value(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(device="cpu", **kw)


def test_kv_host_in_place_flags():
    for add, options in ((add_engine_options, engine_options), (add_kv_tier_options, kv_tier_options)):
        p = argparse.ArgumentParser()
        add(p)
        assert options(p.parse_args(["--kv-host-gib", "1", "--no-kv-host-in-place"]))["kv_host_in_place"] is False
        assert options(p.parse_args(["--kv-host-gib", "1", "--kv-host-in-place"]))["kv_host_in_place"] is True
        assert "kv_host_in_place" not in options(p.parse_args(["--kv-host-gib", "1"]))


# ---- the engine on the tiny model -------------------------------------------------------------------------

EBS = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0)
# 120 tokens each: 7 full blocks + 8; a repeat of the first after the others evicted it hits 7 blocks in T1,
# 4 of them read in place (blocks 1-4)
LONG_PROMPTS = [[1000 * (i + 1) + 3 * j for j in range(120)] for i in range(3)]


def run_long_calls(llm: LLM) -> list[list[int]]:
    outs = [llm.generate([p], GREEDY, progress=False)[0].token_ids for p in LONG_PROMPTS]
    return outs + [llm.generate([p], GREEDY, progress=False)[0].token_ids for p in LONG_PROMPTS[:2]]


def test_engine_same_greedy_tokens_in_place_copied_and_without_tiers(tiny_model_path):
    outs, stats = {}, {}
    for name, cfg in (("off", {}), ("copied", {"kv_host_gib": 0.002, "kv_host_in_place": False}),
                      ("in place", {"kv_host_gib": 0.002})):
        llm = LLM(str(tiny_model_path), device="cpu", dtype="float32", num_blocks=12, block_size=EBS, **cfg)
        try:
            tiers = llm.core.tiers
            if cfg:
                assert tiers.in_place == (name == "in place")
                assert llm.core.runner.kv_cache.shape[2] == 12 + (tiers.host.num_slots if tiers.in_place else 0)
                assert ("read in place" in llm.core.startup_line) == tiers.in_place
            outs[name] = run_long_calls(llm)
            stats[name] = llm.core.kv_stats()
            assert_all_blocks_free(llm.core)
            if cfg:
                assert tiers.host.in_use == set()
                tiers.host.check()
        finally:
            llm.close()
    assert outs["in place"] == outs["copied"] == outs["off"]
    assert stats["off"].prefix_hit_tokens == 0
    for name in ("copied", "in place"):
        assert stats[name].prefix_hit_tokens == 2 * 7 * EBS  # both repeats: their 7 full prompt blocks
        host = stats[name].tiers["host"]
        # copied: the first repeat's 7 copies evict all of the second's blocks; in place it copies 3, so the
        # second repeat finds its first block in T0 still (13 T1 hits), and reads blocks 1-4 of each in place
        assert (host.hits, host.in_place) == ((13, 8) if name == "in place" else (14, 0))


def test_in_place_reads_are_a_metric():
    from agentrt.engine.kv_host import TierStats
    from agentrt.server.metrics import Metrics
    from tests.server.test_metrics import sample, state

    m = Metrics()
    m.render(state(kv_tiers={"host": TierStats(blocks=5, hits=3, in_place=2)}))
    m.render(state(kv_tiers={"host": TierStats(blocks=5, hits=9, in_place=6)}))
    assert sample(m, "agentrt:kv_tier_in_place_reads_total", tier="host") == 6
    assert sample(m, "agentrt:kv_tier_hits_total", tier="host") == 9


def test_engine_of_several_layer_groups_copies_host_blocks_or_refuses_in_place(tmp_path):
    """A windowed model (tiny Gemma 3: window and full layer groups) keeps today's copies by default and refuses
    kv_host_in_place=True with a reason."""
    import os

    from agentrt.engine.loader import load_tokenizer, resolve_model
    from tests.engine.test_kv_layer_groups_engine import gemma3_config
    from tests.engine.test_moe_models import make_hf

    make_hf(gemma3_config(), seed=5).save_pretrained(tmp_path)
    load_tokenizer(resolve_model(os.environ.get("AGENTRT_TEST_TOKENIZER"))).save_pretrained(tmp_path)
    cfg = {"device": "cpu", "dtype": "float32", "num_blocks": 64, "block_size": 4, "kv_host_gib": 0.001}
    with pytest.raises(ValueError, match=r"kv_host_in_place: .* layer group\(s\) with windows; .* full-attention group "
                                         r"only \(kv_host_in_place=False copies"):
        LLM(str(tmp_path), kv_host_in_place=True, **cfg)
    llm = LLM(str(tmp_path), **cfg)
    try:
        assert llm.core.kv_layout.num_groups > 1 and not llm.core.tiers.in_place
        assert "read in place" not in llm.core.startup_line
        assert llm.core.runner.kv_cache.shape[2] == 64 and llm.core.tiers.host.data is not None
    finally:
        llm.close()
