"""The policies on constructed states: exact queue levels after each hook, fixed `now` values."""

from __future__ import annotations

import pytest

import agentrt
from agentrt.engine.policy import make_policy
from agentrt.engine.request import Request
from agentrt.engine.sampling_params import SamplingParams
from agentrt._errors import ConfigError
from agentrt.policies import ATLAS, MLFQ, PLAS
from agentrt.policies.autellix import TTL_SETTINGS


def call(rid: str, program: str | None = "p", *, prompt: int = 4, arrival: float = 0.0, thread: str | None = None) -> Request:
    return Request(rid, [1] * prompt, SamplingParams(), program_id=program, thread_id=thread, arrival_time=arrival)


def plas(**kw) -> PLAS:
    # queues [0,10) [10,20) [20,40) [40,inf); quanta 5, 10, 20, inf
    kw = {"num_queues": 4, "first_boundary": 10, "quantum": 5, "service": "tokens", **kw}
    return PLAS(**kw)


def run_call(pol, req: Request, tokens: int, now: float) -> None:
    """Arrive, receive `tokens` units of service in one step, finish."""
    pol.on_arrival(req, now)
    pol.on_step([req], [0.0], [tokens], now)
    pol.on_finish(req, now)


def test_registered_by_name():
    assert isinstance(make_policy("plas"), PLAS)
    assert isinstance(make_policy("atlas", service="tokens"), ATLAS)
    assert isinstance(make_policy("mlfq"), MLFQ)
    assert PLAS.preemptive and ATLAS.preemptive and MLFQ.preemptive


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"num_queues": 0}, "num_queues"),
        ({"quantum": -1}, "quantum"),
        ({"first_boundary": 0}, "first_boundary"),
        ({"beta": 0}, "beta"),
        ({"service": "joules"}, "'joules'"),
        ({"backfill_s": -1.0}, "backfill_s.*-1.0"),
        ({"backfill_s": "soon"}, "backfill_s.*'soon'"),
    ],
)
def test_bad_config_names_the_value(kwargs, needle):
    with pytest.raises(agentrt.ConfigError, match=needle):
        PLAS(**kwargs)


def test_plas_and_atlas_backfill_by_default_and_ttl_settings_do_not():
    assert PLAS().backfill_s == 1.0 and ATLAS().backfill_s == 1.0 and PLAS(backfill_s=None).backfill_s is None
    assert PLAS(**TTL_SETTINGS).backfill_s is None and MLFQ().backfill_s is None


def test_new_call_enters_queue_of_program_service():
    pol = plas()
    run_call(pol, call("a0"), 3, now=1.0)
    assert pol.programs["p"].attained == 3
    b = call("b", arrival=2.0)
    pol.on_arrival(b, 2.0)
    assert pol.level(b) == 0
    run_call(pol, call("a1"), 12, now=3.0)  # attained 15 -> queue [10, 20)
    c = call("c", arrival=4.0)
    pol.on_arrival(c, 4.0)
    assert pol.level(c) == 1
    run_call(pol, call("a2"), 40, now=5.0)  # attained 55 -> last queue
    d = call("d", arrival=6.0)
    pol.on_arrival(d, 6.0)
    assert pol.level(d) == 3
    other = call("o", program="q", arrival=7.0)  # a fresh program starts at the top
    pol.on_arrival(other, 7.0)
    assert pol.level(other) == 0
    assert sorted([d, other, c], key=pol.priority) == [other, c, d]


def test_quantum_exhaustion_demotes_one_level_to_the_back():
    pol = plas()
    a, b = call("a", arrival=0.0), call("b", program="q", arrival=1.0)
    pol.on_arrival(a, 0.0)
    pol.on_arrival(b, 1.0)
    assert sorted([b, a], key=pol.priority) == [a, b]
    pol.on_step([a], [0.0], [4], now=2.0)
    assert (pol.level(a), pol.state(a).quantum_used) == (0, 4)
    pol.on_step([a], [0.0], [1], now=3.0)  # 5 >= quantum 5 of queue 0
    assert (pol.level(a), pol.state(a).quantum_used, pol.state(a).entered_at) == (1, 0, 3.0)
    assert sorted([a, b], key=pol.priority) == [b, a]
    pol.on_step([a], [0.0], [9], now=4.0)
    assert pol.level(a) == 1
    pol.on_step([a], [0.0], [1], now=5.0)  # 10 >= quantum 10 of queue 1
    assert pol.level(a) == 2
    pol.on_step([a], [0.0], [1000], now=6.0)
    pol.on_step([a], [0.0], [1000], now=7.0)
    assert pol.level(a) == 3  # the last queue never demotes further


def test_fcfs_within_a_queue_by_entry_time():
    pol = plas()
    a, b = call("a", program="pa", arrival=0.0), call("b", program="pb", arrival=1.0)
    pol.on_arrival(a, 0.0)
    pol.on_arrival(b, 1.0)
    pol.on_step([a, b], [0.0, 0.0], [5, 5], now=2.0)  # both demoted in the same step
    assert sorted([b, a], key=pol.priority) == [a, b]  # ties on entry time fall back to arrival
    c = call("c", program="pc", arrival=0.5)
    pol.on_arrival(c, 3.0)
    pol.on_step([c], [0.0], [5], now=3.0)
    assert sorted([c, b, a], key=pol.priority) == [a, b, c]


def test_time_service_counts_executor_seconds_not_tokens():
    pol = PLAS(num_queues=3, first_boundary=0.5, quantum=0.2)
    a = call("a")
    pol.on_arrival(a, 0.0)
    pol.on_step([a], [0.15], [500], now=1.0)
    assert pol.level(a) == 0 and pol.state(a).total_service == pytest.approx(0.15)
    pol.on_step([a], [0.06], [1], now=2.0)
    assert pol.level(a) == 1
    pol.on_finish(a, 2.0)
    assert pol.programs["p"].attained == pytest.approx(0.21)


def test_starving_call_is_promoted_and_only_its_own_counters_reset():
    pol = plas(beta=2.0)
    run_call(pol, call("a0"), 10, now=0.0)  # attained 10
    a = call("a1", arrival=0.0)
    pol.on_arrival(a, 0.0)
    assert pol.level(a) == 1
    pol.before_schedule([a], [], now=19.0)  # W = 19 < beta * T = 20
    assert pol.level(a) == 1 and pol.state(a).wait == 19.0
    pol.before_schedule([a], [], now=20.0)  # W = 20 >= 20: promote
    st = pol.state(a)
    assert (st.level, st.entered_at, st.wait, st.service, st.promotions) == (0, 20.0, 0.0, 0.0, 1)
    assert pol.programs["p"].wait == 20.0 and pol.programs["p"].attained == 10
    # a running call is never promoted and accrues no wait
    b = call("b1", arrival=21.0)
    pol.on_arrival(b, 21.0)
    pol.before_schedule([], [b], now=100.0)
    assert pol.level(b) == 1 and pol.state(b).wait == 0.0


def test_program_wait_counts_toward_starvation():
    pol = plas(beta=2.0)
    run_call(pol, call("a0"), 10, now=0.0)
    a = call("a1")
    pol.on_arrival(a, 0.0)
    pol.before_schedule([a], [], now=20.0)  # promoted; program W = 20
    pol.on_step([a], [0.0], [5], now=21.0)  # demoted again: T_call = 5
    pol.on_finish(a, 21.0)
    assert pol.programs["p"].attained == 15 and pol.programs["p"].wait == 20.0
    b = call("a2", arrival=22.0)
    pol.on_arrival(b, 22.0)
    assert pol.level(b) == 1
    pol.before_schedule([b], [], now=31.0)  # (20 + 9) / 15 < 2
    assert pol.level(b) == 1
    pol.before_schedule([b], [], now=32.0)  # (20 + 10) / 15 >= 2
    assert pol.level(b) == 0


def test_no_promotion_with_infinite_beta():
    pol = plas(beta=float("inf"))
    run_call(pol, call("a0"), 10, now=0.0)
    a = call("a1")
    pol.on_arrival(a, 0.0)
    pol.before_schedule([a], [], now=1e9)
    assert pol.level(a) == 1


def test_atlas_critical_path_is_max_over_parallel_threads():
    pol = ATLAS(num_queues=4, first_boundary=10, quantum=100, service="tokens")
    t1, t2 = call("t1", thread="1"), call("t2", thread="2")
    pol.on_arrival(t1, 0.0)
    pol.on_arrival(t2, 0.0)
    assert pol.state(t1).start_priority == pol.state(t2).start_priority == 0
    pol.on_step([t1, t2], [0.0, 0.0], [10, 30], now=1.0)
    pol.on_finish(t1, 1.0)
    pol.on_finish(t2, 1.0)
    prog = pol.programs["p"]
    assert (prog.critical, prog.attained) == (30, 40)  # max(0 + 10, 0 + 30), not the sum
    nxt = call("n", arrival=2.0)
    pol.on_arrival(nxt, 2.0)
    assert pol.state(nxt).start_priority == 30 and pol.level(nxt) == 2  # [20, 40)
    pol.on_step([nxt], [0.0], [5], now=3.0)
    pol.on_finish(nxt, 3.0)
    assert prog.critical == 35
    # PLAS on the same history puts the next call in the last queue (attained 45)
    p = PLAS(num_queues=4, first_boundary=10, quantum=100, service="tokens")
    for r, n in ((call("t1"), 10), (call("t2"), 30), (call("n"), 5)):
        run_call(p, r, n, now=0.0)
    nxt = call("m")
    p.on_arrival(nxt, 4.0)
    assert p.level(nxt) == 3


def test_atlas_stale_critical_path_does_not_shrink():
    pol = ATLAS(num_queues=4, first_boundary=10, quantum=100, service="tokens")
    run_call(pol, call("a"), 25, now=0.0)
    late = call("b")
    pol.on_arrival(late, 1.0)
    assert pol.state(late).start_priority == 25
    pol.on_step([late], [0.0], [2], now=2.0)
    pol.on_finish(late, 2.0)
    assert pol.programs["p"].critical == 27


def test_victim_is_the_last_entrant_of_the_lowest_queue():
    pol = plas()
    run_call(pol, call("x0", program="long"), 50, now=0.0)
    long1, long2 = call("l1", program="long", arrival=1.0), call("l2", program="long", arrival=2.0)
    short = call("s", program="short", arrival=3.0)
    for r, t in ((long1, 1.0), (long2, 2.0), (short, 3.0)):
        pol.on_arrival(r, t)
    assert pol.pick_victim([short, long1, long2]) is long2
    assert pol.pick_victim([short, long1]) is long1
    assert pol.pick_victim([short]) is short


def test_program_state_dropped_after_end_and_last_call():
    pol = plas()
    a = call("a")
    pol.on_arrival(a, 0.0)
    pol.end_program("p")
    pol.before_schedule([], [a], now=1.0)
    assert "p" in pol.programs  # a call is still in the engine
    pol.on_finish(a, 2.0)
    assert "p" not in pol.programs
    lone = call("lone", program=None)
    run_call(pol, lone, 3, now=3.0)  # a call without a program is its own one-call program
    assert pol.programs == {}


def test_mlfq_skip_join_by_predicted_prefill():
    pol = MLFQ(num_queues=4, quantum=5, service="tokens")  # quanta 5, 10, 20, inf
    levels = []
    for n in (3, 5, 7, 20, 21, 500):
        r = call(f"r{n}", program=None, prompt=n)
        pol.on_arrival(r, 0.0)
        levels.append(pol.level(r))
    assert levels == [0, 0, 1, 2, 3, 3]


def test_mlfq_demotes_and_promotes_after_alpha_wait():
    pol = MLFQ(num_queues=4, quantum=5, alpha=3.0, service="tokens")
    a = call("a", program=None, prompt=2)
    pol.on_arrival(a, 0.0)
    pol.on_step([a], [0.0], [6], now=1.0)
    assert pol.level(a) == 1
    pol.before_schedule([a], [], now=3.5)  # waited 2.5 since last served
    assert pol.level(a) == 1
    pol.on_step([a], [0.0], [1], now=4.0)  # served: the wait restarts
    pol.before_schedule([a], [], now=6.5)
    assert pol.level(a) == 1
    pol.before_schedule([a], [], now=7.0)
    assert pol.level(a) == 0 and pol.state(a).promotions == 1
    # programs do not matter: a call of a program with a long history still enters at the top
    run_call(pol, call("h", program="p", prompt=1), 1000, now=8.0)
    fresh = call("f", program="p", prompt=1)
    pol.on_arrival(fresh, 9.0)
    assert pol.level(fresh) == 0


def test_displacement_only_across_queues_and_can_be_switched_off():
    pol = plas()
    run_call(pol, call("long0", program="long"), 12, now=1.0)  # program "long" now in queue 1
    running_same = call("r0", program="other", arrival=2.0)
    running_low = call("r1", program="long", arrival=2.0)
    waiting = call("w", program="new", arrival=1.5)
    for r, t in ((running_same, 2.0), (running_low, 2.0), (waiting, 1.5)):
        pol.on_arrival(r, t)
    assert (pol.level(running_same), pol.level(running_low), pol.level(waiting)) == (0, 1, 0)
    assert pol.priority(waiting) < pol.priority(running_same)  # same queue, entered earlier ...
    assert not pol.displaces(waiting, running_same)  # ... still no preemption for a tie
    assert pol.displaces(waiting, running_low)
    # by default a better call displaces a worse one for a seat only (its blocks stay cached), never for blocks
    assert not pol.preemptive and pol.displaces_for_seats
    assert plas(preempt=True).preemptive and plas(preempt=True).displaces_for_seats is False
    off = plas(preempt=False)
    assert not off.preemptive and not off.displaces_for_seats
    with pytest.raises(ConfigError, match="preempt must be"):
        plas(preempt="blocks")


def test_live_service_moves_a_fan_out_down_together():
    # queues [0,10) [10,20) [20,40) [40,inf); the root call leaves the program at 3 units
    for live in (True, False):
        pol = plas(live=live, quantum=100)
        run_call(pol, call("root"), 3, now=0.0)
        branches = [call(f"b{i}", thread=str(i), arrival=1.0) for i in range(4)]
        for b in branches:
            pol.on_arrival(b, 1.0)
        assert [pol.level(b) for b in branches] == [0] * 4
        pol.on_step(branches[:2], [0.0, 0.0], [2, 2], now=2.0)  # live service 3 + 4 = 7: still queue 0
        assert [pol.level(b) for b in branches] == [0] * 4
        pol.on_step(branches[:2], [0.0, 0.0], [2, 2], now=3.0)  # 3 + 8 = 11: the program is in queue 1
        pol.before_schedule(branches[2:], branches[:2], now=3.0)
        assert [pol.level(b) for b in branches] == ([1] * 4 if live else [0] * 4)
        late = call("late", thread="9", arrival=4.0)
        pol.on_arrival(late, 4.0)  # a new call enters at the live priority too
        assert pol.level(late) == (1 if live else 0)
        for b in branches[:2]:
            pol.on_finish(b, 5.0)
        assert pol.programs["p"].attained == 11 and pol.programs["p"].in_flight == 0


def test_atlas_live_priority_is_the_longest_running_thread():
    pol = ATLAS(num_queues=4, first_boundary=10, quantum=100, service="tokens")
    threads = [call(f"t{i}", thread=str(i)) for i in range(3)]
    for t in threads:
        pol.on_arrival(t, 0.0)
    pol.on_step(threads, [0.0] * 3, [6, 6, 6], now=1.0)  # 18 in total, but the longest thread has 6
    assert [pol.level(t) for t in threads] == [0, 0, 0]
    pol.on_step(threads[:1], [0.0], [5], now=2.0)  # one thread reaches 11
    assert [pol.level(t) for t in threads] == [1, 0, 0]
    pol.before_schedule(threads[1:], threads[:1], now=2.0)
    assert [pol.level(t) for t in threads] == [1, 1, 1]


def test_program_with_a_running_call_is_not_starving():
    pol = plas(beta=1.0)
    run_call(pol, call("a0"), 10, now=0.0)  # attained 10: new calls enter queue 1
    running, sibling = call("a1", thread="1"), call("a2", thread="2")
    pol.on_arrival(running, 0.0)
    pol.on_arrival(sibling, 0.0)
    pol.before_schedule([sibling], [running], now=50.0)  # waits behind its own program only
    assert pol.state(sibling).wait == 0.0 and pol.programs["p"].wait == 0.0 and pol.level(sibling) == 1
    # two waiting siblings and nothing running: the program's W counts the 5 s once
    pol.before_schedule([running, sibling], [], now=55.0)
    assert pol.programs["p"].wait == 5.0 and pol.state(sibling).wait == 5.0
    # and W >= beta * T (5 < 10: not yet) ... (10 >= 10: one of the two is promoted, the older first)
    assert pol.level(running) == pol.level(sibling) == 1
    pol.before_schedule([running, sibling], [], now=60.0)
    assert sorted((pol.level(r), r.request_id) for r in (running, sibling)) == [(0, "a1"), (1, "a2")]
    # request-level MLFQ still counts every call's own wait
    m = MLFQ(num_queues=4, quantum=5, alpha=3.0, service="tokens")
    r1, r2 = call("m1", prompt=50), call("m2", prompt=50)
    for r in (r1, r2):
        m.on_arrival(r, 0.0)
    m.before_schedule([r2], [r1], now=3.0)
    assert m.level(r2) == 0 and m.state(r2).promotions == 1


@pytest.mark.parametrize("order", ["program", "call"])
def test_order_within_a_queue(order):
    pol = plas(order=order)
    old_later = call("old-2", program="old", arrival=5.0)
    new_first = call("new-1", program="new", arrival=3.0)
    old_first = call("old-1", program="old", arrival=1.0)
    pol.on_arrival(old_first, 1.0)
    pol.on_arrival(new_first, 3.0)
    pol.on_arrival(old_later, 5.0)
    ranked = sorted([old_later, new_first, old_first], key=pol.priority)
    expect = ["old-1", "old-2", "new-1"] if order == "program" else ["old-1", "new-1", "old-2"]
    assert [r.request_id for r in ranked] == expect
    with pytest.raises(agentrt.ConfigError, match="'fifo'"):
        plas(order="fifo")


def test_service_credited_from_other_replicas_orders_the_program():
    """`credit_service` (a Ray replica's sync): the program's service elsewhere counts as its own, as totals
    (a repeated credit does not add up), applied on the step thread's next `before_schedule`."""
    pol = plas()
    pol.credit_service("p", 25.0, 25.0)  # 25 units on other replicas: queue [20, 40)
    pol.credit_service("p", 25.0, 25.0)
    assert "p" not in pol.programs  # queued, not applied from the caller's thread
    pol.before_schedule([], [], 1.0)
    assert pol.programs["p"].elsewhere == 25.0 and pol.programs["p"].active == 0
    a, fresh = call("a", arrival=2.0), call("f", program="q", arrival=2.5)
    pol.on_arrival(a, 2.0)
    pol.on_arrival(fresh, 2.5)
    assert pol.level(a) == 2 and pol.level(fresh) == 0
    assert sorted([a, fresh], key=pol.priority) == [fresh, a]
    pol.on_step([a], [0.0], [3], now=3.0)
    pol.on_finish(a, 3.0)
    assert pol.programs["p"].attained == 3  # its own service here stays apart from the credit
    assert pol.live_priority(pol.programs["p"]) == 28.0
    atlas = ATLAS(num_queues=4, first_boundary=10, quantum=5, service="tokens")
    atlas.credit_service("p", 50.0, 12.0)  # ATLAS orders by the critical path: 12 -> queue [10, 20)
    atlas.before_schedule([], [], 0.0)
    b = call("b")
    atlas.on_arrival(b, 1.0)
    assert atlas.level(b) == 1


def test_a_credited_program_with_no_call_is_dropped_as_idle():
    pol = plas()
    pol.idle_ttl_s = 10.0
    pol.credit_service("p", 5.0, 5.0)
    pol.before_schedule([], [], 0.0)
    assert "p" in pol.programs
    pol.before_schedule([], [], 11.0)
    assert "p" not in pol.programs


def test_outranks_paused_programs_by_queue_then_program_age():
    pol = plas(pins_by_rank=True)
    run_call(pol, call("old-0", "old", arrival=0.0), 25, now=0.0)  # 25 units: queue 2
    run_call(pol, call("mid-0", "mid", arrival=1.0), 3, now=1.0)  # 3 units: queue 0
    new = call("new-0", "new", arrival=2.0)
    pol.on_arrival(new, 2.0)  # queue 0, the newest program
    assert pol.outranks(new, "old")  # a better queue
    assert not pol.outranks(new, "mid")  # same queue, an older program
    assert pol.outranks(new, "gone")  # a program with no state ranks last
    resumed = call("old-1", "old", arrival=3.0)
    pol.on_arrival(resumed, 3.0)
    assert not pol.outranks(resumed, "mid") and not pol.outranks(resumed, "new")
    by_call = plas(pins_by_rank=True, order="call")
    run_call(by_call, call("a-0", "a"), 3, now=0.0)
    b = call("b-0", "b", arrival=1.0)
    by_call.on_arrival(b, 1.0)
    assert not by_call.outranks(b, "a")  # FCFS by call within a queue: no pin gives way inside it
    assert MLFQ().outranks(b, "a") is False  # ranks calls, not programs


def test_headroom_is_left_by_the_last_queue_and_new_programs_take_outranked_pins():
    assert not plas().keeps_headroom and plas().new_take_pins and plas().pins_by_rank  # PLAS's defaults
    pol = plas(headroom=True)
    assert pol.keeps_headroom
    run_call(pol, call("long-0", "long"), 45, now=0.0)  # 45 units: queue 3, the last
    run_call(pol, call("mid-0", "mid"), 25, now=0.0)  # queue 2
    last, mid, new = call("long-1", "long"), call("mid-1", "mid"), call("new-0", "new")
    for r in (last, mid, new):
        pol.on_arrival(r, 1.0)
    assert [pol.leaves_headroom(r) for r in (last, mid, new)] == [True, False, False]
    off = plas(headroom=False, new_take_pins=False)
    assert not off.keeps_headroom and not off.new_take_pins
    assert not plas(num_queues=1, headroom=True).keeps_headroom  # one queue: nobody ranks better
    from agentrt.policies.autellix import TTL_SETTINGS

    ttl = PLAS(**TTL_SETTINGS)  # measured on full-size agents without either (autellix.py)
    assert not ttl.keeps_headroom and not ttl.new_take_pins
