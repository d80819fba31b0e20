"""Layer groups in the KV manager (engine.kv_layout): exact state on a tiny pool, and the property machine of
test_kv_properties run with a full group and two window groups.

A window group frees the blocks before what its window sees (they stay cached under their group's hash); a
prefix hit takes the full groups' whole chain and the window groups' last blocks before the boundary, with
NULL_BLOCK entries before them; the boundary moves down to where every group has what it needs."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from agentrt.engine.kv_cache_manager import KVCacheManager, group_hash
from agentrt.engine.kv_layout import NULL_BLOCK, KVGroup, KVLayout
from agentrt.engine.request import Request
from agentrt.engine.sampling_params import SamplingParams
from tests.engine import test_kv_properties as props
from tests.engine.test_kv_cache_manager import admit as run
from tests.engine.test_kv_cache_manager import decode

BS = 4


def args(windows, kinds=()):
    return SimpleNamespace(num_layers=len(windows), windows=tuple(windows), layer_kinds=tuple(kinds))


def test_layout_gemma3_270m_shape():
    """18 layers, a full layer after every 5 sliding ones: pages of 3 layers, 1 full group then 5 window groups."""
    w = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    layout = KVLayout.from_args(args(w))
    assert layout.page_layers == 3 and layout.num_groups == 6
    assert layout.groups[0] == KVGroup(None, (5, 11, 17))
    assert layout.groups[1] == KVGroup(512, (0, 1, 2)) and layout.groups[5] == KVGroup(512, (13, 14, 15, 16)[1:])
    slots = layout.layer_slots()
    assert slots[5] == (0, 0) and slots[17] == (0, 2) and slots[0] == (1, 0) and slots[16] == (5, 2)
    # what a 32k-token conversation holds: 2048 full pages + 5 groups x (32 window blocks + the one filling)
    held = sum(layout.live_blocks(g, 32768, 16) for g in range(6)) * layout.page_layers
    assert held == 2048 * 3 + 5 * 33 * 3
    assert KVLayout.from_args(args(w), swa_full=True).groups == (KVGroup(None, tuple(range(18))),)


def test_layout_one_rule_is_one_group_and_recurrent_layers_keep_no_kv():
    assert KVLayout.from_args(args([None] * 4)) == KVLayout((KVGroup(None, (0, 1, 2, 3)),), 4, 4)
    assert KVLayout.from_args(args([8] * 2)).groups == (KVGroup(8, (0, 1)),)
    hybrid = KVLayout.from_args(args([None] * 8, ["linear_attention"] * 3 + ["attention"]
                                     + ["linear_attention"] * 3 + ["attention"]))
    assert hybrid.groups == (KVGroup(None, (3, 7)),) and hybrid.page_layers == 2
    assert hybrid.layer_slots() == [None, None, None, (0, 0), None, None, None, (0, 1)]
    gptoss = KVLayout.from_args(args([128, None] * 12))
    assert [g.window for g in gptoss.groups] == [None, 128] and gptoss.page_layers == 12


def make_kv(num_blocks=24, window=8) -> KVCacheManager:
    layout = KVLayout((KVGroup(None, (1,)), KVGroup(window, (0,))), 1, 2)
    return KVCacheManager(num_blocks, BS, layout=layout)


def req(rid, tokens, max_tokens=16):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def test_window_group_frees_blocks_that_left_the_window():
    kv = make_kv()
    r = req("a", range(12))
    run(kv, r)
    assert r.block_ids == [0, 1, 2] and r.extra_tables == [[3, 4, 5]]  # both groups: blocks 0-2 of the sequence
    decode(kv, r, 100)  # computing position 12: the window (8) sees 5..12, block 0 (0..3) can go
    assert r.block_ids == [0, 1, 2, 6] and r.extra_tables == [[NULL_BLOCK, 4, 5, 7]]
    assert kv.pool.ref_cnt[3] == 0 and 3 in kv.pool.free_queue
    assert kv.pool.block_hash[3] == group_hash(kv.block_hashes(r, 1)[0], 1)  # still cached
    assert kv.num_free_blocks == 24 - 7
    for t in range(101, 105):  # positions 13..16: block 1 (4..7) leaves the window at 16
        decode(kv, r, t)
    assert r.extra_tables == [[NULL_BLOCK, NULL_BLOCK, 5, 7, 9]] and r.block_ids == [0, 1, 2, 6, 8]
    assert kv.blocks_for(17) == 5 + 3  # between steps: the full group's 5, the window's 2 + the one filling
    kv.free(r)
    assert kv.num_free_blocks == 24 and all(c == 0 for c in kv.pool.ref_cnt)


def test_prefix_hit_takes_the_window_blocks_before_the_boundary():
    kv = make_kv()
    a = req("a", range(20))
    run(kv, a)
    assert a.extra_tables == [[0 + 5, 6, 7, 8, 9]]  # the prompt computed in one chunk: every block of it
    decode(kv, a, 7)  # position 20: blocks 0..2 of the window group leave it
    assert a.extra_tables[0][:3] == [NULL_BLOCK] * 3
    kv.free(a)
    b = req("b", [*range(20), 7, 8, 9])  # the next turn: 21 tokens shared, 5 full blocks
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 20 and list(hits) == [0, 1, 2, 3, 4]
    # from position 20 the window sees 13..20: blocks 3 and 4 of the window group; before them nothing
    assert hits.extra == [[NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 8, 9]]
    assert kv.allocate_slots(b, 3, hits)
    assert b.block_ids == [0, 1, 2, 3, 4, 11] and b.extra_tables == [[NULL_BLOCK] * 3 + [8, 9, 10]]
    kv.free(b)
    assert kv.num_free_blocks == 24


def test_boundary_moves_down_to_where_every_group_has_its_window():
    kv = make_kv()
    a = req("a", range(20))
    run(kv, a)
    kv.free(a)
    h = kv.block_hashes(a, 5)
    kv.pool.block_hash[kv.pool.cached.pop(group_hash(h[3], 1))] = None  # the window group's block 3 was evicted
    b = req("b", [*range(20), 1])
    hits, num_hit = kv.get_computed_blocks(b)
    # boundary 5 needs window blocks 3, 4; boundary 4 needs 2, 3: the last boundary that works is 3 (needs 1, 2)
    assert num_hit == 12 and list(hits) == [0, 1, 2] and hits.extra == [[NULL_BLOCK, 6, 7]]


def test_fork_and_copy_on_write_per_group():
    kv = make_kv()
    a = req("a", range(10))
    run(kv, a)
    child = req("c", range(10))
    kv.fork(a, child)
    assert child.extra_tables == a.extra_tables and kv.pool.ref_cnt[a.extra_tables[0][2]] == 2
    decode(kv, child, 5)  # writes position 10 in the shared, partly filled block 2 of each group
    copies = kv.take_pending_copies()
    assert copies == [(a.block_ids[2], child.block_ids[2]), (a.extra_tables[0][2], child.extra_tables[0][2])]
    for r in (a, child):
        kv.free(r)
    assert kv.num_free_blocks == 24


class GroupedKVMachine(props.KVMachine):
    """The property machine of test_kv_properties with a full group and two window groups (windows 5 and 9):
    every group's slots hold what its request wrote at the positions its window still sees."""

    LAYOUT = KVLayout((KVGroup(None, (0,)), KVGroup(5, (1,)), KVGroup(9, (2,))), 1, 3)
    NUM = 14

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(self.NUM, props.BS, layout=self.LAYOUT)
        self.slots = [[None] * props.BS for _ in range(self.NUM)]

    def snapshot(self, req):
        pool = self.kv.pool
        return (list(pool.ref_cnt), list(pool.free_queue), dict(pool.cached), [list(t) for t in req.tables])

    @precondition(lambda self: any(self.pending.values()))
    @rule(i=st.integers(0, 10))
    def compute(self, i):
        assert self.kv.take_pending_copies() == []
        req = self.pick([r for r in self.running if self.pending[r.request_id]], i)
        n = self.pending[req.request_id]
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
            for g, table in enumerate(req.tables):
                block = table[pos // props.BS]
                assert block >= 0 and self.kv.pool.ref_cnt[block] == 1, f"write into shared block {block}"
                assert self.kv.pool.block_hash[block] is None
                self.slots[block][pos % props.BS] = (g, *self.content(req, pos))
        req.num_computed_tokens += n
        self.pending[req.request_id] = 0
        self.kv.cache_blocks(req)

    def check_no_leak(self):
        assert self.kv.num_free_blocks == self.NUM and self.kv.pool.ref_cnt == [0] * self.NUM

    @invariant()
    def ref_counts_match_block_tables(self):
        owners = [0] * self.NUM
        for r in self.running:
            for t in r.tables:
                for b in t:
                    if b >= 0:
                        owners[b] += 1
        for r in self.waiting:
            assert r.block_ids == [] and r.extra_tables == []
        assert self.kv.pool.ref_cnt == owners
        assert set(self.kv.pool.free_queue) == {b for b in range(self.NUM) if owners[b] == 0}

    @invariant()
    def block_tables_cover_what_is_scheduled(self):
        for r in self.running:
            n = -(-(r.num_computed_tokens + self.pending[r.request_id]) // props.BS)
            assert [len(t) for t in r.tables] == [n] * 3

    @invariant()
    def hash_index_matches_content(self):
        pool = self.kv.pool
        assert {h: b for b, h in enumerate(pool.block_hash) if h is not None} == pool.cached
        for h, b in pool.cached.items():
            g, salt, prefix = self.slots[b][-1]
            assert len(prefix) % props.BS == 0, f"cached block {b} is not a full block"
            start = len(prefix) - props.BS
            assert self.slots[b] == [(g, salt, prefix[: start + j + 1]) for j in range(props.BS)]
            probe = Request("probe", list(prefix), SamplingParams(), cache_salt=salt)
            assert group_hash(self.kv.block_hashes(probe, len(prefix) // props.BS)[-1], g) == h

    @invariant()
    def every_request_reads_its_own_kv(self):
        pass  # each group's: each_group_reads_back_its_own_kv

    @invariant()
    def each_group_reads_back_its_own_kv(self):
        bs = props.BS
        for r in self.running:
            done = r.num_computed_tokens  # positions computed (a pending chunk has not written yet)
            for g, table in enumerate(r.tables):
                lo = self.LAYOUT.first_needed_block(g, done, bs) if g else 0
                for b in range(len(table)):
                    if b < lo:
                        continue
                    for pos in range(b * bs, min((b + 1) * bs, done)):
                        assert table[b] >= 0, f"{r.request_id} group {g} lost block {b} its window needs"
                        assert self.slots[table[b]][pos % bs] == (g, *self.content(r, pos)), (r.request_id, g, pos)


TestGroupedKV = GroupedKVMachine.TestCase
TestGroupedKV.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])


def test_window_blocks_come_back_from_the_host_tier():
    """A conversation's window-group blocks demoted to T1 with the rest: the next turn's hit loads them back
    (every group's blocks before the boundary), instead of stopping where T0 lost them."""
    import torch

    from agentrt.engine.kv_tiers import KVTiers

    layout = KVLayout((KVGroup(None, (1,)), KVGroup(8, (0,))), 1, 2)
    shape = (1, 2, BS, 1, 4)
    tiers = KVTiers(shape, torch.float32, "fake", host_bytes=64 * 2 * BS * 4 * 4)
    kv = KVCacheManager(14, BS, layout=layout, tiers=tiers)
    a = req("a", range(20))
    run(kv, a)
    kv.free(a)
    other = req("o", range(100, 128))  # takes every block (7 per group): a's are demoted
    run(kv, other, 27)
    kv.free(other)
    assert not any(h in kv.pool.cached for h in kv.block_hashes(a, 5))
    b = req("b", [*range(20), 7])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 20 and len(hits) == 5 and hits.extra[0][:3] == [NULL_BLOCK] * 3
    h = kv.block_hashes(b, 5)
    assert [kv.pool.block_hash[x] for x in hits] == h
    assert [kv.pool.block_hash[x] for x in hits.extra[0][3:]] == [group_hash(h[3], 1), group_hash(h[4], 1)]
    assert b.num_tier_loaded_tokens == 7 * BS  # five full-group blocks and the window group's two
    assert kv.allocate_slots(b, 1, hits)
    kv.free(b)
    assert kv.num_free_blocks == 14
    tiers.close()
