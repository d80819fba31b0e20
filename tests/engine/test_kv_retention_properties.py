"""Property test: random sequences of requests, steps, aborts, clock jumps and program operations
(start, reserve, pin, release, end) through the real `Scheduler` on a tiny pool, with the pool's
invariants checked after each (tests/engine/test_kv_retention.py `check`), and two more: a waiting
request left waiting could not have run even with every pin given way, and once every request and
program has ended, every block is free and nothing of any program is left.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from agentrt.engine.config import EngineConfig
from agentrt.engine.kv_cache_manager import KVCacheManager
from agentrt.engine.policy import make_policy
from agentrt.engine.program_ops import EndProgram, Pin, Release, Reserve, StartProgram
from agentrt.engine.request import Request, RequestStatus
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.scheduler import Scheduler
from tests.engine.test_kv_retention import check

BS = 4
NUM_BLOCKS = 12
MAX_SEQS = 3
BUDGET = 32
PROGRAMS = st.sampled_from(["a", "b", "c", None])
OWNED = st.sampled_from(["a", "b", "c"])
PREFIXES = [[], [0, 1, 2, 0, 1, 2, 0, 1], [1, 1, 2, 2, 0, 0, 1, 1, 2]]


class RetentionMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.now = 0.0
        cfg = EngineConfig(block_size=BS, num_blocks=NUM_BLOCKS, device="cpu", max_num_seqs=MAX_SEQS,
                           max_num_batched_tokens=BUDGET)
        self.s = Scheduler(cfg, KVCacheManager(NUM_BLOCKS, BS, max_reserved_fraction=0.5), make_policy("fcfs"),
                           clock=lambda: self.now)
        self.ids = 0
        self.last: dict[str | None, list[int]] = {}  # a program's latest sequence (its next call extends it)

    def live(self) -> list[Request]:
        return self.s.running + self.s.waiting

    @rule(program=PROGRAMS, prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 2), max_size=6),
          extend=st.booleans(), max_tokens=st.integers(1, 6))
    def add(self, program, prefix, tail, extend, max_tokens):
        if len(self.live()) >= 6:
            return
        base = self.last.get(program, prefix) if extend else prefix
        tokens = (base + tail)[:28] or [0]
        self.ids += 1
        req = Request(f"r{self.ids}", tokens, SamplingParams(max_tokens=max_tokens), program_id=program,
                      arrival_time=self.now)
        self.s.add_request(req)

    @rule(dt=st.sampled_from([0.0, 0.5, 2.0]))
    def step(self, dt):
        self.now += dt
        out = self.s.schedule()
        if not out.preempted and self.s.waiting and len(self.s.running) < MAX_SEQS and out.total_tokens < BUDGET:
            head = self.s.waiting[0]  # left waiting: it must not have fit, even with every pin given way,
            hits, num_hit = self.s.kv.get_computed_blocks(head)  # or its next block is computed this step
            deferred = (num_hit + self.s.kv.block_size < head.num_tokens
                        and self.s.kv.block_hashes(head, len(hits) + 1)[-1] in self.s._computed_this_step(out))
            n = min(head.num_tokens - num_hit, BUDGET - out.total_tokens)
            need = self.s.kv.blocks_for(num_hit + n) - len(hits) + sum(1 for b in hits if self.s.kv.pool.ref_cnt[b] == 0)
            assert deferred or need > self.s.kv.num_allocatable(head.program_id, protect=hits)  # hits cannot give way
        self.s.update_from_output(out, 0.01)
        for r in list(out.reqs):
            if r.finished or r.num_computed_tokens < r.num_tokens:
                continue
            r.append_token(self.ids % 3)
            if r.num_output_tokens >= r.sampling.max_tokens:
                self.last[r.program_id] = list(r.all_token_ids)
                self.s.finish(r, RequestStatus.FINISHED_LENGTH)

    @rule(i=st.integers(0, 10))
    def abort(self, i):
        live = self.live()
        if live:
            self.s.finish(live[i % len(live)], RequestStatus.FINISHED_ABORTED)

    @rule(program=OWNED, ttl=st.sampled_from([0.0, 1.0, 5.0]))
    def pin(self, program, ttl):
        self.s.program_op(Pin(program, ttl))

    @rule(program=OWNED, tokens=st.integers(0, 40))
    def reserve(self, program, tokens):
        self.s.program_op(Reserve(program, tokens))

    @rule(program=OWNED, op=st.sampled_from([StartProgram, Release, EndProgram]))
    def lifecycle(self, program, op):
        self.s.program_op(op(program))

    @invariant()
    def pool_invariants(self):
        check(self.s.kv, self.live())

    def teardown(self):
        for r in self.live():
            self.s.finish(r, RequestStatus.FINISHED_ABORTED)
        for p in ("a", "b", "c"):
            self.s.program_op(EndProgram(p))
        kv = self.s.kv
        assert kv.num_free_blocks == NUM_BLOCKS
        assert not kv.owners and not kv.pool.reservations and not kv.pool.held and kv.pool.unused_reserved() == 0
        check(kv)


TestRetention = RetentionMachine.TestCase
TestRetention.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])
