"""Property test: random admit / schedule / compute / sample / fork / preempt / free sequences
against a tiny `KVCacheManager`, with a model of what each physical KV slot holds.

The model writes `(salt, token prefix)` into a slot when a step computes that position and applies
copy-on-write copies before any write, like the runner. After every step: ref counts equal block
table occupancy, the free queue holds exactly the unreferenced blocks, the hash index points only to
full blocks whose content hashes to their key, and every request reads back exactly its own KV (so a
wrong hit, merge or missing copy is caught). Freeing everything leaks nothing.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agentrt.engine.kv_cache_manager import KVCacheManager
from agentrt.engine.request import Request
from agentrt.engine.sampling_params import SamplingParams

BS = 4
NUM_BLOCKS = 6
MAX_TOKENS = 20  # per request; keeps a few requests alive in 8 blocks
VOCAB = st.integers(0, 2)  # few distinct tokens: prefixes collide often (hits, merges)
SALTS = st.sampled_from([None, None, "s"])
PREFIXES = [[], [0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 2, 0, 1, 2, 0, 1, 1, 1]]  # shared "system prompts"
RARELY = st.integers(0, 3)  # destructive rules act on 0 only, so requests live long enough to share


class KVMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS)
        self.slots: list[list[tuple | None]] = [[None] * BS for _ in range(NUM_BLOCKS)]
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.pending: dict[str, int] = {}  # tokens allocated but not yet computed, by request id
        self.ids = 0
        self.seen: list[tuple[tuple[int, ...], str | None]] = []  # sequences admitted so far, with salt

    # ---- helpers -------------------------------------------------------------------------
    def new_id(self) -> str:
        self.ids += 1
        return f"r{self.ids}"

    def snapshot(self, req: Request):
        pool = self.kv.pool
        return (list(pool.ref_cnt), list(pool.free_queue), dict(pool.cached), list(req.block_ids))

    def pick(self, reqs: list[Request], i: int) -> Request:
        return reqs[i % len(reqs)]

    def idle(self) -> list[Request]:
        return [r for r in self.running if not self.pending[r.request_id]]

    @staticmethod
    def content(req: Request, pos: int) -> tuple:
        return (req.cache_salt, tuple(req.all_token_ids[: pos + 1]))

    def apply_copies(self) -> None:
        """The runner copies before the step's forward; nothing writes in between, so copy now."""
        for src, dst in self.kv.take_pending_copies():
            self.slots[dst] = list(self.slots[src])

    def release(self, req: Request) -> None:
        self.kv.free(req)
        self.pending.pop(req.request_id, None)

    # ---- rules ---------------------------------------------------------------------------
    def room(self) -> bool:
        return len(self.waiting) + len(self.running) < 5

    @precondition(room)
    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(VOCAB, max_size=6), salt=SALTS)
    def add_request(self, prefix, tail, salt):
        self.add(prefix + tail, salt)

    @precondition(lambda self: self.room() and self.seen)
    @rule(i=st.integers(0, 10), tail=st.lists(VOCAB, min_size=1, max_size=5), again=st.booleans())
    def add_continuation(self, i, tail, again):
        """The next turn of a conversation (a seen sequence + new tokens) or the same prompt again."""
        tokens, salt = self.seen[i % len(self.seen)]
        self.add(list(tokens) if again else list(tokens) + tail, salt)

    def add(self, tokens: list[int], salt: str | None) -> None:
        tokens = tokens[:MAX_TOKENS - 2] or [0]
        self.waiting.append(Request(self.new_id(), tokens, SamplingParams(), cache_salt=salt))
        self.seen.append((tuple(tokens), salt))

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 10), frac=st.floats(0.01, 1.0))
    def admit(self, i, frac):
        req = self.pick(self.waiting, i)
        hits, num_hit = self.kv.get_computed_blocks(req)
        assert num_hit == len(hits) * BS < req.num_tokens
        n = max(1, round(frac * (req.num_tokens - num_hit)))
        before = self.snapshot(req)
        if not self.kv.allocate_slots(req, n, hits):
            assert self.snapshot(req) == before
            return
        self.apply_copies()
        req.num_computed_tokens = num_hit
        self.pending[req.request_id] = n
        self.waiting.remove(req)
        self.running.append(req)

    @precondition(lambda self: any(r.num_computed_tokens < r.num_tokens for r in self.idle()))
    @rule(i=st.integers(0, 10), frac=st.floats(0.01, 1.0))
    def schedule_running(self, i, frac):
        req = self.pick([r for r in self.idle() if r.num_computed_tokens < r.num_tokens], i)
        n = max(1, round(frac * (req.num_tokens - req.num_computed_tokens)))
        before = self.snapshot(req)
        if self.kv.allocate_slots(req, n):
            self.apply_copies()
            self.pending[req.request_id] = n
        else:
            assert self.snapshot(req) == before

    @precondition(lambda self: any(self.pending.values()))
    @rule(i=st.integers(0, 10))
    def compute(self, i):
        """The forward pass of one scheduled chunk: writes, then cache_blocks."""
        assert self.kv.take_pending_copies() == []
        req = self.pick([r for r in self.running if self.pending[r.request_id]], i)
        n = self.pending[req.request_id]
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
            block = req.block_ids[pos // BS]
            assert self.kv.pool.ref_cnt[block] == 1, f"write into shared block {block}"
            assert self.kv.pool.block_hash[block] is None, f"write into cached block {block}"
            self.slots[block][pos % BS] = self.content(req, pos)
        req.num_computed_tokens += n
        self.pending[req.request_id] = 0
        self.kv.cache_blocks(req)

    @precondition(lambda self: any(r.num_computed_tokens == r.num_tokens < MAX_TOKENS for r in self.idle()))
    @rule(i=st.integers(0, 10), token=VOCAB)
    def sample(self, i, token):
        req = self.pick([r for r in self.idle() if r.num_computed_tokens == r.num_tokens < MAX_TOKENS], i)
        req.append_token(token)
        self.seen.append((tuple(req.all_token_ids), req.cache_salt))

    @precondition(lambda self: self.idle() and self.room())
    @rule(i=st.integers(0, 10))
    def fork(self, i):
        parent = self.pick(self.idle(), i)
        child = Request(self.new_id(), parent.all_token_ids, SamplingParams(), cache_salt=parent.cache_salt)
        self.kv.fork(parent, child)
        self.pending[child.request_id] = 0
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 10), go=RARELY)
    def preempt(self, i, go):
        if go:
            return
        req = self.pick(self.running, i)
        self.release(req)
        req.num_computed_tokens = 0
        self.running.remove(req)
        self.waiting.append(req)

    @precondition(lambda self: self.running or self.waiting)
    @rule(i=st.integers(0, 10))
    def finish(self, i):
        req = self.pick(self.running + self.waiting, i)
        self.release(req)
        (self.running if req in self.running else self.waiting).remove(req)

    @rule(go=st.integers(0, 7))
    def free_everything(self, go=0):
        if go:
            return
        for req in self.running + self.waiting:
            self.release(req)
        self.running, self.waiting = [], []
        self.check_no_leak()

    def teardown(self):
        self.free_everything()

    # ---- invariants ----------------------------------------------------------------------
    def check_no_leak(self):
        kv = self.kv
        assert kv.num_free_blocks == kv.num_blocks
        assert kv.pool.ref_cnt == [0] * kv.num_blocks

    @invariant()
    def ref_counts_match_block_tables(self):
        owners = [0] * NUM_BLOCKS
        for r in self.running:
            for b in r.block_ids:
                owners[b] += 1
        for r in self.waiting:
            assert r.block_ids == [] and r.num_computed_tokens == 0
        assert self.kv.pool.ref_cnt == owners
        used = sum(1 for c in owners if c)
        assert self.kv.num_free_blocks + used == NUM_BLOCKS
        free = list(self.kv.pool.free_queue)
        assert len(free) == len(set(free))
        assert set(free) == {b for b in range(NUM_BLOCKS) if owners[b] == 0}

    @invariant()
    def block_tables_cover_what_is_scheduled(self):
        for r in self.running:
            assert len(r.block_ids) == self.kv.blocks_for(r.num_computed_tokens + self.pending[r.request_id])

    @invariant()
    def hash_index_matches_content(self):
        pool = self.kv.pool
        assert {h: b for b, h in enumerate(pool.block_hash) if h is not None} == pool.cached
        for h, b in pool.cached.items():
            salt, prefix = self.slots[b][-1]
            assert len(prefix) % BS == 0, f"cached block {b} is not a full block"
            start = len(prefix) - BS
            assert self.slots[b] == [(salt, prefix[: start + j + 1]) for j in range(BS)]
            probe = Request("probe", list(prefix), SamplingParams(), cache_salt=salt)
            assert self.kv.block_hashes(probe, len(prefix) // BS)[-1] == h

    @invariant()
    def every_request_reads_its_own_kv(self):
        for r in self.running:
            for pos in range(r.num_computed_tokens):
                got = self.slots[r.block_ids[pos // BS]][pos % BS]
                assert got == self.content(r, pos), f"{r.request_id} position {pos}: {got}"


KVMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestKVMachine = KVMachine.TestCase
