"""The replica router as a pure function (agentrt.scale.router): ranked choices, stickiness, the load
guard, re-homing when a replica goes; hypothesis over random replica stats."""

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrt.scale import ProgramHomes, ReplicaStats, RouterConfig, route
from agentrt.scale.router import overloaded

CFG = RouterConfig(max_load=4, max_load_ratio=2.0)


def stats(*loads: int, dead: tuple[int, ...] = ()) -> list[ReplicaStats]:
    return [ReplicaStats(f"r{i}", load, i not in dead) for i, load in enumerate(loads)]


def flat(ranked: list[list[str]]) -> list[str]:
    return [r for rank in ranked for r in rank]


def test_a_new_program_is_placed_on_the_least_loaded_replica_and_stays():
    d = route("p1", 100, stats(3, 1, 2), None, CFG)
    assert (d.ranked[0], d.home, d.reason) == (["r1"], "r1", "placed")
    d = route("p1", 100, stats(0, 3, 0), "r1", CFG)  # now busier than the others, but under the guard
    assert (d.ranked[0], d.home, d.reason) == (["r1"], "r1", "home")
    assert sorted(flat(d.ranked)) == ["r0", "r1", "r2"]  # the others follow, in case the home refuses


def test_the_load_guard_moves_a_program_off_a_hot_replica():
    assert not overloaded(4, 0, CFG)  # not over the absolute threshold
    assert not overloaded(9, 4, CFG)  # over it, but not 2x the least-loaded's load + 1
    assert overloaded(11, 4, CFG)
    d = route("p1", 100, stats(11, 4, 6), "r0", CFG)
    assert (d.ranked[0], d.home, d.reason) == (["r1"], "r1", "rehomed-overload")


def test_a_program_whose_replica_went_re_homes():
    d = route("p1", 100, stats(0, 5, 2, dead=(0,)), "r0", CFG)
    assert (d.ranked[0], d.home, d.reason) == (["r2"], "r2", "rehomed-gone")
    assert "r0" not in flat(d.ranked)
    d = route("p1", 100, stats(0, 5), "r7", CFG)  # no longer among the candidates at all
    assert d.reason == "rehomed-gone" and d.home == "r0"


def test_calls_without_a_program_and_short_calls_go_by_load():
    d = route(None, 100, stats(2, 0, 1), None, CFG, key="req-1")
    assert (d.ranked[0], d.home, d.reason) == (["r1"], None, "least-loaded")
    autellix = RouterConfig(sticky_tokens=2048)
    d = route("p1", 300, stats(2, 0, 1), "r0", autellix)  # short: least-loaded, its home kept
    assert (d.ranked[0], d.home, d.reason) == (["r1"], "r0", "least-loaded")
    d = route("p1", 4000, stats(2, 0, 1), "r0", autellix)  # long: home
    assert (d.ranked[0], d.reason) == (["r0"], "home")


def test_no_replica_alive():
    d = route("p1", 10, stats(1, 1, dead=(0, 1)), "r0", CFG)
    assert d.ranked == [] and d.reason == "none"


def test_a_new_program_goes_where_the_fewest_live_programs_are():
    """Three programs in tool gaps on r0 (queue empty now) will call again: a new program goes to r1, whose
    one program is running a call, not to the replica that looks idle this instant."""
    live = [ReplicaStats("r0", 0, programs=3), ReplicaStats("r1", 1, programs=1), ReplicaStats("r2", 2, programs=1)]
    d = route("p9", 100, live, None, CFG)
    assert (flat(d.ranked), d.home, d.reason) == (["r1", "r2", "r0"], "r1", "placed")
    d = route("p9", 100, live, "r0", CFG)  # a program that lives there stays: placement only places
    assert (d.ranked[0], d.reason) == (["r0"], "home")
    d = route(None, 100, live, None, CFG)  # a call of no program: by load
    assert d.ranked[0] == ["r0"]


def test_live_programs_per_replica_are_those_routed_within_the_window():
    homes = ProgramHomes()
    homes.set("a", "r0", now=0.0)
    homes.set("b", "r0", now=5.0)
    homes.set("c", "r1", now=8.0)
    homes.set("a", "r1", now=9.0)  # moved, and routed again: counts once, where it is now
    assert homes.active(10.0, 30.0) == {"r0": 1, "r1": 2}
    assert homes.active(36.0, 30.0) == {"r1": 2}  # b last called 31 s ago
    assert homes.active(100.0, 30.0) == {}


def test_live_programs_are_those_running_or_in_a_short_tool_gap():
    """With call starts and ends heard (a Ray router's on_request_routed / on_request_completed): a program
    running a call counts however long ago it was routed; an idle one counts for the 90th percentile of the
    tool gaps seen since its call ended, so a finished program stops counting soon instead of for active_s."""
    from agentrt.scale import router as rt

    homes = ProgramHomes()
    for i in range(rt.MIN_GAPS):  # tool gaps of 0.1 .. 1.6 s: their 90th percentile is 1.5 s
        homes.set(f"g{i}", "r9", now=0.0)
        homes.call_started(f"g{i}", 0.0)
        homes.call_done(f"g{i}", 1.0)
        homes.call_started(f"g{i}", 1.0 + 0.1 * (i + 1))
        homes.call_done(f"g{i}", 2.0)
        homes.forget(f"g{i}")
    assert homes.gap_window(30.0) == pytest.approx(1.5) and homes.gap_window(1.0) == 1.0
    homes.set("long", "r0", now=0.0)
    homes.call_started("long", 0.0)  # a call running for 100 s: counts throughout
    homes.set("idle", "r1", now=0.0)
    homes.call_started("idle", 0.0)
    homes.call_done("idle", 99.0)  # in a tool gap since 99 s
    homes.set("new", "r1", now=99.5)  # placed, its call not yet heard to start
    assert homes.active(100.0, 30.0) == {"r0": 1, "r1": 2}
    assert homes.active(100.6, 30.0) == {"r0": 1, "r1": 1}  # idle 1.6 s > 1.5 s: gone (or finished)
    homes.call_done("long", 101.0)
    homes.call_started("idle", 101.0)  # it called again: running
    assert homes.active(101.0, 30.0) == {"r0": 1, "r1": 2}
    assert homes.active(102.8, 30.0) == {"r1": 2}  # (its own gap of 2 s made the window 1.6 s)
    homes.set("idle", "r0", now=102.0)  # moved while its call runs: counted where it lives now
    assert homes.active(102.8, 30.0) == {"r0": 1, "r1": 1}
    homes.call_done("unknown", 1.0)  # a program the router never saw (or forgot): ignored
    assert homes.replica_gone("r0") == 2 and homes.active(102.8, 30.0) == {"r1": 1}
    homes.call_done("idle", 103.0)  # its call ends after its replica went: nothing left to count
    assert homes.active(103.0, 30.0) == {"r1": 1}


def test_equal_replicas_share_new_programs():
    homes = {route(f"p{i}", 10, stats(0, 0, 0, 0), None, CFG).home for i in range(64)}
    assert homes == {"r0", "r1", "r2", "r3"}


def test_bad_config_is_refused_naming_the_field():
    for kw, name in (({"sticky_tokens": -1}, "sticky_tokens"), ({"max_load": 1.5}, "max_load"),
                     ({"max_load_ratio": 0.5}, "max_load_ratio"), ({"active_s": 0}, "active_s")):
        with pytest.raises(ValueError, match=name):
            RouterConfig(**kw)


def test_program_homes_are_bounded_and_forgotten():
    homes = ProgramHomes(capacity=3)
    for i in range(5):
        homes.set(f"p{i}", f"r{i % 2}")
    assert len(homes) == 3 and homes.get("p0") is None and homes.get("p4") == "r0"
    homes.get("p2")
    homes.set("p2", "r1")  # routed again: the most recent
    homes.set("p5", "r1")
    assert homes.get("p3") is None and homes.get("p2") == "r1"
    assert homes.replica_gone("r1") == 2 and homes.counts() == {"r0": 1}
    homes.forget("p4")
    homes.set(None, "r0")
    assert len(homes) == 0
    with pytest.raises(ValueError, match="capacity"):
        ProgramHomes(0)
    small = ProgramHomes(capacity=1)
    small.set("a", "r0", now=0.0)
    small.call_started("a", 0.0)
    assert small.active(1.0, 30.0) == {"r0": 1}
    small.set("b", "r1", now=1.0)  # a, running, is dropped for b: it no longer counts anywhere
    assert small.active(1.0, 30.0) == {"r1": 1}
    small.call_done("a", 2.0)  # its call ends after it was dropped: nothing to count down
    assert small.active(2.0, 30.0) == {"r1": 1}


replica_sets = st.lists(st.tuples(st.integers(0, 40), st.booleans(), st.integers(0, 6)), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(replica_sets, st.sampled_from([None, "p1"]), st.integers(0, 5000),
       st.sampled_from([None, "r0", "r1", "r5", "r9"]), st.sampled_from([0, 2048]))
def test_any_stats(reps, pid, tokens, home, sticky):
    cfg = RouterConfig(sticky_tokens=sticky, max_load=4, max_load_ratio=2.0)
    replicas = [ReplicaStats(f"r{i}", load, alive, programs) for i, (load, alive, programs) in enumerate(reps)]
    alive = {r.replica_id: r.load for r in replicas if r.alive}
    spread = {r.replica_id: (r.programs, r.load) for r in replicas if r.alive}
    d = route(pid, tokens, replicas, home, cfg)
    chosen = flat(d.ranked)
    assert sorted(chosen) == sorted(alive) and len(set(chosen)) == len(chosen)  # every live replica, once
    assert all(len(rank) == 1 for rank in d.ranked)
    if not alive:
        assert d.reason == "none"
        return
    least = min(alive.values())
    first = chosen[0]
    if pid is None:
        assert d.home is None and alive[first] == least
    elif tokens < sticky:
        assert d.home == home and alive[first] == least
    elif home in alive and not overloaded(alive[home], least, cfg):
        assert first == home == d.home and d.reason == "home"
    elif home in alive:  # moved off a hot home: onto a least-loaded replica
        assert first == d.home and alive[first] == least and d.reason == "rehomed-overload"
    else:  # placed (or re-homed off a replica that is gone) where the fewest live programs are, then by load
        assert first == d.home and spread[first] == min(spread.values())
        assert d.reason == ("placed" if home is None else "rehomed-gone")
        assert [spread[r] for r in chosen] == sorted(spread.values())
        return
    assert [alive[r] for r in chosen[1:]] == sorted(alive[r] for r in chosen[1:])  # the rest by load


_ops = st.lists(st.tuples(st.sampled_from(["route", "start", "done", "forget", "gone"]), st.sampled_from("abcdef"),
                          st.sampled_from(["r0", "r1", "r2"]), st.floats(0.0, 5.0)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(_ops, st.integers(1, 6))
def test_program_homes_count_running_programs_exactly(ops, capacity):
    """Any sequence of routing, call starts and ends, forgetting and replicas going: the running count per
    replica is exactly the programs with a call running that live there, never negative; nothing outlives
    its bounds; a program with no call running and no recent activity does not count as live."""
    homes, now = ProgramHomes(capacity), 0.0
    for op, pid, replica, dt in ops:
        now += dt
        if op == "route":
            homes.route(pid, 10, {r: 0 for r in ("r0", "r1", "r2")}, RouterConfig(), key=pid, now=now)
        elif op == "start":
            homes.call_started(pid, now)
        elif op == "done":
            homes.call_done(pid, now)
        elif op == "forget":
            homes.forget(pid)
        else:
            homes.replica_gone(replica)
        running = collections.Counter(h.replica for h in homes._homes.values() if h.inflight)
        assert {r: n for r, n in homes._running.items() if n} == dict(running)
        assert all(n >= 0 for n in homes._running.values())
        assert len(homes) <= capacity and all(h.inflight >= 0 for h in homes._homes.values())
        live = homes.active(now, 30.0)
        assert sum(live.values()) <= len(homes)
        assert all(live[r] >= n for r, n in running.items())  # every program running a call is live
        assert homes.active(now + 31.0, 30.0) == running  # a minute later only running programs count
