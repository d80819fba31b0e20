"""The running-set cap (PLAS `running_cap`, the scheduler's `max_running` seam) on exact scheduler state:
a short program arriving behind long ones runs within a bounded number of steps, long programs are not
starved, an engine with room for everyone runs everyone, FCFS is unchanged, and everything is freed."""

from __future__ import annotations

import itertools

import pytest

from agentrt.engine.config import EngineConfig
from agentrt.engine.kv_cache_manager import KVCacheManager
from agentrt.engine.policy import FCFS
from agentrt.engine.request import Request, RequestStatus
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.scheduler import Scheduler
from agentrt.policies import PLAS
from agentrt.policies._multilevel import StepFit

BS = 4


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(policy, *, max_num_seqs: int = 8, num_blocks: int = 256) -> tuple[Scheduler, Clock]:
    clock = Clock()
    cfg = EngineConfig(block_size=BS, num_blocks=num_blocks, device="cpu", max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=64)
    return Scheduler(cfg, KVCacheManager(num_blocks, BS), policy, clock=clock), clock


_BASES = itertools.count(1)


def call(rid: str, program: str, max_tokens: int, arrival: float, prompt: int = 6) -> Request:
    """A call whose prompt shares no block with any other (identical prompts would wait a step for each other:
    the scheduler's in-batch prefix sharing)."""
    base = 1000 * next(_BASES)
    return Request(rid, list(range(base, base + prompt)), SamplingParams(max_tokens=max_tokens),
                   program_id=program, arrival_time=arrival)


def step(s: Scheduler, clock: Clock) -> list[Request]:
    out = s.schedule()
    s.update_from_output(out, 0.01)
    clock.t += 0.01
    for r in out.reqs:
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(7)
            if r.num_output_tokens >= r.sampling.max_tokens:
                s.finish(r, RequestStatus.FINISHED_LENGTH)
    return out.reqs


def assert_all_blocks_free(s: Scheduler) -> None:
    assert s.kv.num_free_blocks == s.kv.num_blocks and all(r == 0 for r in s.kv.pool.ref_cnt)
    assert not s.running and not s.waiting


def plas(**kw) -> PLAS:
    # queues [0, 8) [8, 16) [16, 32) [32, inf) tokens of service; beta in seconds per token of service
    return PLAS(**{"num_queues": 4, "first_boundary": 8, "quantum": 4, "service": "tokens", "beta": 0.05, **kw})


def test_the_cap_holds_while_calls_wait_and_a_short_program_displaces_a_long_one():
    s, clock = make(plas(running_cap=2))
    longs = [call(f"L{i}", f"long{i}", 60, 0.0) for i in range(4)]
    for r in longs:
        s.add_request(r)
    for _ in range(20):
        assert len(step(s, clock)) <= 2 and len(s.running) <= 2  # 8 seats, a cap of 2 while others wait
    assert sum(r.num_output_tokens > 0 for r in longs) >= 2
    short = call("S", "short", 4, clock.t)
    s.add_request(short)
    steps = 0
    while not short.finished:
        step(s, clock)
        steps += 1
    # in at once (the worst long call displaced: its program had more service), then 4 tokens of decode
    assert steps <= 5 and short.first_scheduled_time == pytest.approx(clock.t - 0.01 * steps)
    assert sum(r.num_preemptions for r in longs) >= 1
    while s.has_work():
        step(s, clock)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in longs)
    assert_all_blocks_free(s)


def test_no_long_program_starves_under_a_stream_of_short_ones():
    """A short program arrives every other step for 300 steps; each long program still finishes within a
    bound (anti-starvation: its wait reaches beta x its service and it is lifted to the top queue)."""
    s, clock = make(plas(running_cap=2))
    longs = [call(f"L{i}", f"long{i}", 30, 0.0) for i in range(3)]
    for r in longs:
        s.add_request(r)
    shorts = []
    for t in range(300):
        if t % 2 == 0:
            shorts.append(call(f"S{t}", f"short{t}", 3, clock.t))
            s.add_request(shorts[-1])
        step(s, clock)
    assert all(r.finished for r in longs), [(r.request_id, r.num_output_tokens) for r in longs]
    while s.has_work():
        step(s, clock)
    assert all(r.finished for r in shorts)
    assert_all_blocks_free(s)


def test_an_engine_with_room_runs_everyone_and_fcfs_is_unchanged():
    for policy in (plas(running_cap=2), FCFS()):
        s, clock = make(policy)
        reqs = [call(f"R{i}", f"p{i}", 5, 0.0) for i in range(2)]
        for r in reqs:
            s.add_request(r)
        assert len(step(s, clock)) == 2  # nobody waits: no cap
    s, clock = make(FCFS(), max_num_seqs=8)
    for i in range(6):
        s.add_request(call(f"R{i}", f"p{i}", 5, 0.0))
    assert len(step(s, clock)) == 6  # FCFS has no cap: max_num_seqs alone


def test_auto_cap_is_the_knee_of_the_measured_step_cost():
    fit = StepFit(0.9)
    assert fit.knee(64) is None  # nothing measured yet
    for b in range(1, 65):
        fit.add(b, 0.020 + 0.003 * b)
    # throughput b / (a + c b) reaches 0.9 of a 64-row batch's at b = 0.9*64*a / (a + c*64*0.1) = 29.4
    assert fit.knee(64) == 30 and fit.knee(16) == 12
    flat = StepFit(0.9)
    for b in range(1, 65):
        flat.add(b, 0.003 * b)  # no fixed cost: a wider batch buys no throughput, so no knee to stop at
    assert flat.knee(64) is None
    pol = plas(running_cap="auto")
    s, clock = make(pol)
    s.add_request(call("R", "p", 3, 0.0))
    assert pol.max_running(s.waiting, s.running, 8) is None  # not learned yet
    with pytest.raises(Exception, match="running_cap"):
        plas(running_cap=0)
    with pytest.raises(Exception, match="cap_efficiency"):
        plas(cap_efficiency=1.0)
