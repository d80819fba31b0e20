"""Queue boundaries fitted to the calls' service (agentrt/policies/_fit.py) and the pinned order within a queue."""

from __future__ import annotations

import pytest

from agentrt.engine.request import Request
from agentrt.engine.sampling_params import SamplingParams
from agentrt.policies import ATLAS, PLAS
from agentrt.policies._fit import ServiceFit


def call(rid: str, program: str, arrival: float = 0.0) -> Request:
    return Request(rid, [1] * 4, SamplingParams(), program_id=program, arrival_time=arrival)


def serve(pol: PLAS, req: Request, units: int, now: float) -> None:
    pol.on_arrival(req, now)
    pol.on_step([req], [0.0], [units], now)
    pol.on_finish(req, now)


def test_median_of_the_latest_calls_refitted_every_few():
    fit = ServiceFit(window=4, every=2, min_calls=3)
    assert [fit.add(x) for x in (5.0, 1.0)] == [False, False] and fit.median is None
    assert fit.add(3.0) and fit.median == 3.0  # first fit at min_calls
    assert not fit.add(100.0) and fit.median == 3.0  # refitted every 2 calls only
    assert fit.add(100.0) and fit.median == 51.5  # window of 4: 1, 3, 100, 100
    assert not fit.add(0.0)  # a call that received nothing teaches nothing
    assert len(fit.samples) == 4


def test_plas_boundaries_follow_the_median_call():
    pol = PLAS(service="tokens", num_queues=4, boundary_programs=None)  # "auto": 128 tokens until 8 calls, then 2 median calls
    assert pol.boundaries == [128.0, 256.0, 512.0] and pol.quanta[0] == 64.0
    for i in range(8):
        serve(pol, call(f"c{i}", f"p{i}"), 10, now=float(i))
    assert pol.boundaries == [20.0, 40.0, 80.0] and pol.quanta[:3] == [10.0, 20.0, 40.0]
    # a program that received six calls' worth sits below one that received nothing
    for i in range(6):
        serve(pol, call(f"t{i}", "tree"), 10, now=10.0)
    tree, new = call("t6", "tree", 11.0), call("n0", "new", 11.0)
    pol.on_arrival(tree, 11.0)
    pol.on_arrival(new, 11.0)
    assert pol.level(new) == 0 and pol.level(tree) == 2
    # a fixed boundary stays fixed; a given quantum stays given
    fixed = PLAS(service="tokens", first_boundary=50, num_queues=4)
    given = PLAS(service="tokens", quantum=7, boundary_programs=None)
    for i in range(8):
        serve(fixed, call(f"c{i}", f"p{i}"), 10, now=float(i))
        serve(given, call(f"c{i}", f"p{i}"), 10, now=float(i))
    assert fixed.boundaries == [50, 100, 200] and given.quanta[0] == 7 and given.boundaries[0] == 20.0
    assert ATLAS(service="tokens").boundary_calls == 0.5 and ATLAS().num_queues == 4 and ATLAS().program_fit is None
    with pytest.raises(ValueError, match="first_boundary"):
        PLAS(first_boundary="sometimes")
    with pytest.raises(ValueError, match="boundary_calls"):
        PLAS(boundary_calls=0)
    with pytest.raises(ValueError, match="boundary_programs"):
        PLAS(boundary_programs=-1)


def end(pol: PLAS, program: str, now: float) -> None:
    pol.end_program(program)
    pol.before_schedule([], [], now)


def test_plas_boundary_follows_the_median_finished_program_once_enough_ended():
    pol = PLAS(service="tokens")  # K = 2; calls' worth until 8 programs ended, then 1.5 median programs
    assert pol.num_queues == 2 and pol.boundaries == [128.0]
    for i in range(8):  # 8 calls of 10 units (one program each, still running): 2 median calls
        serve(pol, call(f"c{i}", f"p{i}"), 10, now=float(i))
    assert pol.boundaries == [20.0]
    for i in range(8):  # each program makes two more calls and ends: 30 units each
        serve(pol, call(f"d{i}", f"p{i}"), 10, now=10.0)
        serve(pol, call(f"e{i}", f"p{i}"), 10, now=10.0)
        end(pol, f"p{i}", 11.0)
    assert pol.program_fit.median == 30.0 and pol.boundaries == [45.0]
    for i in range(8):  # more calls do not move it back to calls' worth
        serve(pol, call(f"x{i}", "long"), 10, now=12.0)
    assert pol.boundaries == [45.0]
    fresh, long = call("n", "new", 13.0), call("x8", "long", 13.0)
    pol.on_arrival(fresh, 13.0)
    pol.on_arrival(long, 13.0)
    assert pol.level(fresh) == 0 and pol.level(long) == 1  # 80 units > 45: the second (last) queue
    assert not pol.programs.get("p0")  # ended programs' state is gone


def test_pinned_calls_go_first_within_their_queue_only():
    pol = PLAS(service="tokens", first_boundary=10, num_queues=4)
    serve(pol, call("old0", "old"), 30, now=0.0)  # "old" received 30: queue 2
    pinned, fresh, peer = call("old1", "old", 5.0), call("new0", "new", 6.0), call("mid0", "mid", 4.0)
    serve(pol, call("mid-1", "mid"), 35, now=1.0)  # "mid" in queue 2 as well, older than "new"
    for r in (pinned, fresh, peer):
        pol.on_arrival(r, r.arrival_time)
    order = sorted([pinned, fresh, peer], key=lambda r: pol.pinned_key(r, r.program_id == "old"))
    # the new program (queue 0) before the pinned one (queue 2), which goes ahead of its queue's peer
    assert [r.request_id for r in order] == ["new0", "old1", "mid0"]


def test_programs_that_go_quiet_count_as_finished_for_the_program_fit():
    """Over the HTTP API nobody ends a program: one quiet past 4x the 90th percentile of the gaps programs came back
    after (at least 1 s) counts as finished for the program fit, once, and keeps its state."""
    pol = PLAS(service="tokens")
    assert pol.quiet_s() == 10.0  # before 8 gaps were seen
    for i in range(8):  # 8 programs: a call, a 0.5 s gap, a call
        serve(pol, call(f"a{i}", f"p{i}"), 10, now=0.0)
        serve(pol, call(f"b{i}", f"p{i}"), 10, now=0.5)
    assert pol.quiet_s() == 2.0 and pol.program_fit.median is None
    pol.before_schedule([], [], 2.4)  # quiet 1.9 s
    assert pol.program_fit.median is None
    pol.before_schedule([], [], 2.6)
    assert pol.program_fit.median == 20.0 and pol.boundaries == [30.0]
    assert all(pol.programs[f"p{i}"].presumed for i in range(8))  # state kept
    serve(pol, call("c0", "p0"), 10, now=3.0)  # p0 comes back: its service goes on
    assert pol.programs["p0"].attained == 30.0 and not pol.programs["p0"].presumed
    assert pol.quiet_s() == 2.0  # a program back after it was presumed finished is not a gap
    counted = len(pol.program_fit.samples)
    pol.before_schedule([], [], 4.9)
    assert len(pol.program_fit.samples) == counted
    pol.before_schedule([], [], 5.1)  # quiet again: counted once more, with what it has now
    assert len(pol.program_fit.samples) == counted + 1 and pol.program_fit.samples[-1] == 30.0
    end(pol, "p1", 6.0)
    pol.before_schedule([], [], 6.0)
    assert "p1" not in pol.programs and len(pol.program_fit.samples) == counted + 1  # ended after presumed: once
    serve(pol, call("d2", "p2"), 10, now=7.0)
    end(pol, "p2", 7.0)
    pol.before_schedule([], [], 7.0)
    assert len(pol.program_fit.samples) == counted + 2  # ended after coming back: counted at its end
