"""The recurrent-state pool of hybrid models (engine.recurrent_state), exact state after each operation: live
slots taken zeroed, restored from a snapshot, copied by a fork and given back (the tensors double when full);
snapshots planned at the last block boundary a step reaches, keyed by the chained block hash, registered on
commit, dropped least recently used first, given back on a failed step; prefix hits capped at the last snapshot;
every slot and entry accounted for. Through the engine: preemption and abort give slots back."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agentrt.engine.recurrent_state import RecurrentStatePool, StateShape

SHAPE = StateShape(num_layers=2, conv_dim=3, conv_width=2, num_heads=1, key_dim=2, value_dim=2)


def pool(slots=2, snapshots=3, block_size=4, interval=256):
    p = RecurrentStatePool(SHAPE, slots, snapshots, block_size, "cpu", interval=interval)
    p.block_hashes = lambda req, n: [f"{req.tokens[: (i + 1) * block_size]}".encode() for i in range(n)]
    return p


def req(rid, tokens, computed=0):
    return SimpleNamespace(request_id=rid, tokens=tokens, num_computed_tokens=computed, num_tokens=len(tokens))


def test_slots_zeroed_released_and_grown():
    p = pool(slots=2)
    a, b = req("a", [1] * 5), req("b", [2] * 5)
    assert p.slot(a) == 0 and p.slot(b) == 1 and p.slot(a) == 0
    p.conv[:, 0] = 7.0
    p.on_free(a)
    assert p.free_slots == [0] and p.slot_of == {"b": 1}
    c = req("c", [3] * 5)
    assert p.slot(c) == 0 and float(p.conv[:, 0].abs().sum()) == 0  # zeroed when taken
    d = req("d", [4] * 5)
    assert p.slot(d) == 2 and p.num_slots == 4 and p.free_slots == [3]  # doubled
    p.check()
    for r in (b, c, d):
        p.on_free(r)
    p.on_free(b)  # twice: nothing
    assert sorted(p.free_slots) == [0, 1, 2, 3] and not p.slot_of
    with pytest.raises(ValueError, match="state slot 1 is not held"):
        p.release_slot(1)


def test_fork_copies_the_parent_state():
    p = pool()
    parent, child = req("p", [1] * 6, 6), req("p-1", [1] * 6, 6)
    p.slot_of["p"] = p.new_slot()
    p.ssm[:, 0] = 3.0
    p.conv[:, 0] = 2.0
    p.on_fork(parent, child)
    assert p.slot_of == {"p": 0, "p-1": 1}
    assert torch.equal(p.ssm[:, 1], p.ssm[:, 0]) and torch.equal(p.conv[:, 1], p.conv[:, 0])
    with pytest.raises(ValueError, match="fork target 'p-1' already holds a state slot"):
        p.on_fork(parent, child)


def test_snapshots_planned_committed_restored_and_evicted_lru():
    p = pool(slots=2, snapshots=2, block_size=4)
    a = req("a", list(range(11)))
    step = p.prepare([a], [11])  # a prefill reaching positions 0..10: its last boundary is 8
    key8 = p.block_hashes(a, 2)[-1]
    assert step.snapshots == [[(8, 0)]] and step.pending == [(key8, 0)] and not p.snapshots
    p.commit(step)
    assert list(p.snapshots.items()) == [(key8, 0)] and p.saves == 1
    a.num_computed_tokens, a.num_tokens = 11, 12  # the token it sampled is appended
    a.tokens.append(11)
    step = p.prepare([a], [1])  # position 11 completes block 2 (boundary 12)
    key12 = p.block_hashes(a, 3)[-1]
    assert step.snapshots == [[(1, 1)]]
    p.commit(step)
    assert list(p.snapshots) == [key8, key12]
    # a new request sharing 12 tokens: its hit is capped at the last boundary with a snapshot, and it resumes there
    b = req("b", list(range(12)) + [99, 98, 97])
    hashes = p.block_hashes(b, 3)
    assert p.usable_prefix(hashes) == 3 and p.usable_prefix(hashes[:2]) == 2 and p.usable_prefix([b"x"]) == 0
    p.snap_ssm[:, 0] = 5.0
    b.num_computed_tokens = 8
    assert p.slot(b) == 1 and float(p.ssm[:, 1].min()) == 5.0 and p.hits == 1
    assert list(p.snapshots) == [key12, key8]  # touched: most recently used
    # a third boundary evicts the least recently used (key12) into the new entry
    c = req("c", [7] * 9)
    p.on_free(a)
    step = p.prepare([c], [9])
    assert step.snapshots[0] == [(8, 1)] and key12 not in p.snapshots
    p.abandon(step)  # the forward failed: the entry goes back free, nothing registered
    assert p.free_entries == [1] and list(p.snapshots) == [key8]
    p.check()


def test_resume_without_snapshot_is_refused_and_releases_the_slot():
    p = pool()
    r = req("r", list(range(10)), computed=4)
    with pytest.raises(RuntimeError, match="resumes at token 4 but no state snapshot"):
        p.slot(r)
    assert not p.slot_of and p.num_free_slots == p.num_slots


def test_a_long_prefill_saves_every_interval_and_its_last_boundary():
    p = pool(snapshots=8, block_size=4, interval=8)
    r = req("r", list(range(30)), computed=2)
    p.slot_of["r"] = p.new_slot()  # it computed 2 tokens in an earlier step
    step = p.prepare([r], [27])  # positions 2..28: crosses 8, 16, 24; its last boundary is 28
    assert [d for d, _ in step.snapshots[0]] == [6, 14, 22, 26]
    # entries taken for the last boundary first, then back through the intervals
    assert [k for k, _ in step.pending] == [p.block_hashes(r, b // 4)[-1] for b in (28, 24, 16, 8)]
    q = pool(snapshots=2, block_size=4, interval=8)
    q.slot_of["r"] = q.new_slot()
    assert [d for d, _ in q.prepare([r], [27]).snapshots[0]] == [22, 26]  # two entries: 24 and the last, 28


def test_no_snapshots_without_prefix_caching_or_entries():
    p = pool(snapshots=0)
    step = p.prepare([req("a", list(range(9)))], [9])
    assert step.snapshots == [[]] and not step.pending
    q = pool()
    q.block_hashes = None
    assert q.prepare([req("a", list(range(9)))], [9]).snapshots == [[]]


def test_clear_snapshots_frees_every_entry():
    p = pool(snapshots=3)
    for i in range(3):
        r = req(f"r{i}", [i] * 4)
        p.commit(p.prepare([r], [4]))
        p.on_free(r)
    assert len(p.snapshots) == 3 and not p.free_entries
    p.clear_snapshots()
    assert not p.snapshots and sorted(p.free_entries) == [0, 1, 2]
    p.check()


class PoolMachine(RuleBasedStateMachine):
    """Random requests taking slots, stepping (snapshots planned, then committed or abandoned), forking, freeing and
    resetting the cache: every slot and entry held once; a request's slot holds exactly what its steps wrote; a
    restored slot equals the snapshot it resumed from."""

    def __init__(self):
        super().__init__()
        self.p = pool(slots=1, snapshots=3, block_size=4, interval=8)
        self.live: dict[str, SimpleNamespace] = {}
        self.n = 0

    @rule(length=st.integers(1, 14))
    def arrive(self, length):
        self.n += 1
        r = req(f"r{self.n}", [self.n % 3] * length)  # few distinct contents: prefixes repeat
        hashes = self.p.block_hashes(r, (length - 1) // 4)
        r.num_computed_tokens = self.p.usable_prefix(hashes) * 4
        before = None
        if r.num_computed_tokens:
            entry = self.p.snapshots[hashes[r.num_computed_tokens // 4 - 1]]
            before = self.p.snap_ssm[:, entry].clone()
        slot = self.p.slot(r)
        if before is not None:
            assert torch.equal(self.p.ssm[:, slot], before)
        else:
            assert float(self.p.ssm[:, slot].abs().sum()) == 0
        self.live[r.request_id] = r

    @precondition(lambda self: self.live)
    @rule(data=st.data(), fail=st.booleans())
    def step(self, data, fail):
        reqs = [r for r in self.live.values() if r.num_computed_tokens < r.num_tokens]
        if not reqs:
            return
        ns = [data.draw(st.integers(1, r.num_tokens - r.num_computed_tokens)) for r in reqs]
        step = self.p.prepare(reqs, ns)
        entries = [e for s in step.snapshots for _, e in s]
        assert len(entries) == len(set(entries)) and all(e not in self.p.snapshots.values() for e in entries)
        keys = set(self.p.snapshots) | {k for k, _ in step.pending}
        full = not self.p.free_entries
        for r, n, s in zip(reqs, ns, step.snapshots):  # at multiples of 8 it crosses and the last block boundary
            start, last = r.num_computed_tokens, (r.num_computed_tokens + n) // 4 * 4
            planned = [b for b in [*range((start // 8 + 1) * 8, last, 8), last] if b > start]
            got = [start + d for d, _ in s]
            assert got == sorted(got) and set(got) <= set(planned)
            for b in planned:  # each saved here, already kept, or no entry was left
                assert b in got or self.p.block_hashes(r, b // 4)[-1] in keys or full
            if planned and last not in got and self.p.block_hashes(r, last // 4)[-1] not in keys:
                assert not got  # the last boundary is taken before any interval one
        if fail:
            self.p.abandon(step)
            return
        for r, n, s, slot in zip(reqs, ns, step.snapshots, step.slots):
            for done, e in s:  # the state after `done` of the step's tokens
                self.p.snap_ssm[:, e] = self.p.ssm[:, slot] + done
            self.p.ssm[:, slot] += n  # what "the model" writes: the slot counts its tokens
            r.num_computed_tokens += n
        self.p.commit(step)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        self.n += 1
        child = req(f"r{self.n}", list(parent.tokens), parent.num_computed_tokens)
        self.p.on_fork(parent, child)
        if child.request_id in self.p.slot_of:
            slots = self.p.slot_of
            assert torch.equal(self.p.ssm[:, slots[child.request_id]], self.p.ssm[:, slots[parent.request_id]])
            self.live[child.request_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        r = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.p.on_free(r)

    @rule()
    def reset(self):
        self.p.clear_snapshots()

    @invariant()
    def accounted(self):
        self.p.check()
        assert set(self.p.slot_of) == set(self.live)
        for rid, r in self.live.items():  # each slot holds its own tokens' count (restored or computed)
            assert float(self.p.ssm[:, self.p.slot_of[rid]].max()) == r.num_computed_tokens

    def teardown(self):
        for r in self.live.values():
            self.p.on_free(r)
        assert self.p.num_free_slots == self.p.num_slots and not self.p.slot_of


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
