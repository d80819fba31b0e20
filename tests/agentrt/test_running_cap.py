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


def test_ttl_settings_displace_for_a_seat_only_and_take_the_worst_ranked_call():
    """PLAS with the TTL settings (`preempt=False`, `victim="newest"`) and a cap: a short program's call takes the
    seat of the worst-ranked running call (a long program's, though a newer program's call runs too), within
    a bounded number of steps; with no cap it waits for a seat as before; no displacement ever for blocks."""
    from agentrt.policies.autellix import TTL_SETTINGS

    s, clock = make(plas(running_cap=2, **TTL_SETTINGS))
    assert s.policy.displaces_for_seats and not s.policy.preemptive
    old = call("L0", "long0", 60, 0.0)
    s.add_request(old)
    for _ in range(12):  # long0 gathers service: queue 1 and below
        step(s, clock)
    new = call("L1", "long1", 60, clock.t)
    s.add_request(new)
    step(s, clock)
    assert set(s.running) == {old, new} and s.policy.level(new) < s.policy.level(old)
    short = call("S", "short", 3, clock.t)
    s.add_request(short)
    step(s, clock)
    # the worst-ranked call (long0's, the lowest queue) gave its seat, not the newest program's (long1)
    assert set(s.running) == {new, short} and old.num_preemptions == 1 and new.num_preemptions == 0
    while not short.finished:
        step(s, clock)
    while s.has_work():
        step(s, clock)
    assert_all_blocks_free(s)
    # no cap: the TTL settings never displace (a seat frees as calls end)
    s, clock = make(PLAS(**{"num_queues": 4, "first_boundary": 8, "quantum": 4, "service": "tokens", **TTL_SETTINGS}),
                    max_num_seqs=2)
    assert not s.policy.displaces_for_seats
    for i in range(2):
        s.add_request(call(f"L{i}", f"long{i}", 30, 0.0))
    for _ in range(12):
        step(s, clock)
    s.add_request(call("S", "short", 3, clock.t))
    for _ in range(5):
        step(s, clock)
    assert s.num_preemptions == 0
    while s.has_work():
        step(s, clock)
    assert_all_blocks_free(s)


def test_two_better_calls_take_two_seats_in_one_step():
    """Displacement counts the seats it has already handed out: two short programs arriving together behind a
    full capped set both run in the next step (the second is not left for a later one)."""
    s, clock = make(plas(running_cap=3))
    longs = [call(f"L{i}", f"long{i}", 40, 0.0) for i in range(4)]
    for r in longs:
        s.add_request(r)
    for _ in range(12):
        step(s, clock)
    assert len(s.running) == 3
    shorts = [call(f"S{i}", f"short{i}", 3, clock.t) for i in range(2)]
    for r in shorts:
        s.add_request(r)
    ran = step(s, clock)
    assert all(r in ran for r in shorts) and len(s.running) == 3
    while s.has_work():
        step(s, clock)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in longs + shorts)
    assert_all_blocks_free(s)


def test_a_binding_cap_seats_in_policy_order_before_pinned_programs():
    """Under the TTL settings a resuming program holding a pin goes first while KV is short (Continuum's order);
    while the running cap binds, seats are short, not KV, and a short program's call takes the seat ahead of a
    long pinned program's next call."""
    from agentrt.engine.program_ops import EndProgram, Pin
    from agentrt.policies.autellix import TTL_SETTINGS

    s, clock = make(plas(running_cap=1, **TTL_SETTINGS))
    s.program_op(Pin("P", 100.0))
    first = call("P0", "P", 40, clock.t)
    s.add_request(first)
    while not first.finished:
        step(s, clock)
    assert s.kv.holds_pin("P")
    a = call("A", "A", 60, clock.t)
    s.add_request(a)
    for _ in range(45):  # A alone (nobody waits: no cap) gathers service down to the last queue, as P did
        step(s, clock)
    assert s.policy.level(a) == 3
    resumed = Request("P1", [*first.all_token_ids, 5, 6], SamplingParams(max_tokens=3), program_id="P",
                      arrival_time=clock.t)
    short = call("S", "short", 3, clock.t)
    s.add_request(resumed)
    s.add_request(short)
    step(s, clock)
    assert s.running == [short] and a.num_preemptions == 1 and resumed.first_scheduled_time is None
    while s.has_work():
        step(s, clock)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in (a, resumed, short))
    s.program_op(EndProgram("P"))  # its pin goes with it
    assert_all_blocks_free(s)


def test_prefill_yield_is_the_chunk_with_most_of_a_long_chunks_throughput():
    fit = StepFit(0.9)
    assert fit.chunk() is None  # nothing measured yet
    for b in range(1, 65):
        fit.add(b, 0.009 + 0.0006 * b)  # a = 9 ms, c = 0.6 ms a token
    # b c / (a + c b) >= 0.9  <=>  b >= 0.9 a / (0.1 c) = 135
    assert fit.chunk() == 135
    pol = plas()
    assert pol.yields_prefill and pol.prefill_yield() == 128  # PLAS's default; before any step is measured
    for b in range(1, 65):
        pol.step_fit.add(b, 0.009 + 0.0006 * b)
    assert pol.prefill_yield() == 135
    assert plas(prefill_yield=64).prefill_yield() == 64
    assert not plas(prefill_yield=False).yields_prefill and not plas(num_queues=1).yields_prefill
    first, later = call("A", "a", 3, 0.0), call("B", "b", 3, 1.0)
    for p in (pol, by_queue := plas(yield_to="queue")):
        p.on_arrival(first, 0.0)
        p.on_arrival(later, 1.0)
    assert pol.yields_to(later, first) and not pol.yields_to(first, later)  # by rank: the older program's call
    assert not by_queue.yields_to(later, first)  # by queue: both in queue 0
    for bad in ({"prefill_yield": 0}, {"prefill_yield": "auto"}, {"yield_to": "class"}):
        with pytest.raises(Exception, match=next(iter(bad))):
            plas(**bad)
    from agentrt.policies.autellix import TTL_SETTINGS, PLAS

    assert not PLAS(**TTL_SETTINGS).yields_prefill  # measured on full-size agents without it
