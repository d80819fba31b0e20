"""The program benchmark runs end to end (tiny model, a handful of programs) and edits only its section."""

from __future__ import annotations

import argparse
import json

import pytest

from agentrt.bench import programs as bench


def test_bench_programs_smoke(tiny_model_path, tmp_path, capsys):
    docs = tmp_path / "programs.md"
    docs.write_text("# `agentrt bench programs`\n\n## Program scheduling, KV-bound (150 blocks)\n\nkeep me\n\n"
                    "## Program scheduling\n\nthe previous run\n")
    argv = ["--model", str(tiny_model_path), "--programs", "4", "--rate", "20", "--policies", "fcfs,plas"]
    assert bench.main([*argv, "--json", "--docs", str(docs)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["results"]) == ["fcfs", "plas"]
    plas = report["results"]["plas"]
    assert plas["latency_s"]["n"] == 4 and plas["vs_fcfs"]["latency_s.mean"] > 0
    assert all(p["output_tokens"] > 0 and p["calls"] >= 1 for p in plas["programs"])
    text = docs.read_text()
    assert text.index("## Program scheduling\n") < text.index("| plas |") < text.index("keep me")  # newest first
    assert text.count("## Program scheduling\n") == 1 and "the previous run" in text.split("## History")[1]
    assert "Command: `agentrt" in text and "Machine:" in text


def test_seeds_pool_and_the_breakdown_adds_up(tiny_model_path, capsys):
    """--seeds 2: every program of both seeds' runs in one result, the makespan their mean; --breakdown: each
    class's parts (queue, own compute, width, others' prefill, between steps, tools) add up to its latency."""
    argv = ["--model", str(tiny_model_path), "--programs", "4", "--rate", "20", "--policies", "fcfs,plas",
            "--seeds", "2", "--breakdown", "--json"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["seeds"] == 2
    for r in report["results"].values():
        assert r["latency_s"]["n"] == 8 and len(r["makespans_s"]) == 2
        assert r["makespan_s"] == pytest.approx(sum(r["makespans_s"]) / 2)
        short = r["breakdown"]["short"]
        assert short["programs"] + r["breakdown"].get("long", {}).get("programs", 0) == 8
        parts = sum(short[p] for p in ("queue", "own", "width", "prefill", "between", "tools_client"))
        assert parts == pytest.approx(short["latency"], rel=0.05) and short["own"] > 0 and short["steps"] >= 1
    with pytest.raises(SystemExit, match="--breakdown runs in-process"):
        bench.main(["--model", str(tiny_model_path), "--rate", "1", "--breakdown", "--http"])
    with pytest.raises(SystemExit, match="--calibrate goes with --http"):
        bench.main(["--model", str(tiny_model_path), "--rate", "1", "--calibrate"])


def test_measured_saturation_is_the_knee_of_a_closed_loop(tiny_model_path):
    """--http --load: N programs of the mix kept in flight on a fresh FCFS server, for growing N; the best level's
    generated tokens per second, over a program's planned tokens. The levels stop past the knee."""
    from agentrt.bench import programs_http
    from agentrt.bench import workload as wl

    work = wl.make_workload(8, 1.0, 0)
    sat = programs_http.measure_saturation(work, str(tiny_model_path), dict(bench.ENGINE), levels=(1, 4, 16),
                                           settle_s=0.5, measure_s=2.0, poll_s=0.25)
    curve = {int(n): c for n, c in sat["curve"].items()}
    assert list(curve)[0] == 1 and set(curve) <= {1, 4, 16}
    best = max(c["output_tok_s"] for c in curve.values())
    assert best > 0 and sat["output_tok_s"] == pytest.approx(best, abs=0.01)
    assert curve[sat["in_flight"]]["output_tok_s"] == pytest.approx(best, abs=0.01)
    ran = list(curve)
    for i in range(1, len(ran) - 1):  # a level runs only while the ones before it kept rising
        assert curve[ran[i]]["output_tok_s"] >= max(curve[m]["output_tok_s"] for m in ran[:i])
    drawn = wl.make_workload(400, 1.0, 0)
    assert sat["tokens_per_program"] == pytest.approx(sum(wl.planned_output_tokens(s) for s in drawn) / 400)
    assert sat["programs_per_s"] == pytest.approx(sat["output_tok_s"] / sat["tokens_per_program"])
    with pytest.raises(ValueError, match="levels"):
        programs_http.measure_saturation(work, str(tiny_model_path), dict(bench.ENGINE), levels=(0,))


def test_planned_output_tokens_follow_the_plans():
    """A tree search asks for (root + depth x width + final) calls' tokens, a chat for one call's, a ReAct loop
    for a whole number of calls' within its range."""
    from agentrt.bench import workload as wl

    kinds = set()
    for spec in wl.make_workload(40, 1.0, 3):
        n = wl.planned_output_tokens(spec)
        kinds.add(spec.kind)
        if spec.kind == "tree":
            assert n == (2 + wl.TREE["depth"] * wl.TREE["width"]) * wl.TREE["max_tokens"]
        elif spec.kind == "chat":
            assert n == wl.CHAT["max_tokens"]
        else:
            calls, rest = divmod(n, wl.REACT["max_tokens"])
            assert rest == 0 and wl.REACT["calls"][0] <= calls <= wl.REACT["calls"][1]
    assert kinds == {"chat", "react", "tree"}


def test_bench_programs_over_http(tiny_model_path, tmp_path, capsys, monkeypatch):
    """The same programs through a fresh `agentrt serve` per policy: every program done with its calls, the
    classes' latencies, the server's counters, a timeline of every call and its plot."""
    from agentrt.bench import workload as wl

    monkeypatch.setattr(wl, "MIX", dict(wl.MIX))  # --mix and --tree change these module tables: restored after
    monkeypatch.setattr(wl, "TREE", dict(wl.TREE))
    monkeypatch.setattr(bench, "TREE", wl.TREE)
    plot = tmp_path / "timeline.png"
    argv = ["--model", str(tiny_model_path), "--programs", "6", "--rate", "20", "--mix", "react=0.5,tree=0.5",
            "--tree", "2x2", "--policies", "fcfs,plas+ttl:running_cap=2", "--http", "--timeline", str(plot), "--json"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["results"]) == ["fcfs", "plas+ttl:running_cap=2"]
    for r in report["results"].values():
        assert r["latency_s"]["n"] == 6 and all(p["calls"] >= 1 and p["output_tokens"] > 0 for p in r["programs"])
        calls = sum(p["calls"] for p in r["programs"])
        assert len(r["timeline"]) == calls and all(c["end"] > c["start"] >= 0 for c in r["timeline"])
        assert r["by_class"]["long"]["n"] + r["by_class"]["short"]["n"] == 6 and 0 <= r["prefix_hit_rate"] <= 1
    assert report["results"]["plas+ttl:running_cap=2"]["vs_fcfs"]["makespan"] > 0
    assert plot.stat().st_size > 10_000
    sim = report["simulated"]  # the simulator on the same workloads, as the server ran them
    assert list(sim) == ["fcfs", "plas+ttl:running_cap=2"] and all(s["mean"] > 0 for s in sim.values())
    assert report["config"]["step_costs"].startswith("step costs: ")  # which fit priced the simulated steps
    rows = bench.simulated_table(report).splitlines()[2:]
    assert len(rows) == 2 and rows[0].startswith("| fcfs |") and rows[0].endswith("| 1.00 | 1.00 | +0.00 |")
    from agentrt.bench import programs_http

    args = argparse.Namespace(first_boundary=None, quantum=None, beta=None)
    assert programs_http.serve_args(*bench.policy_spec("plas:beta=2:victim=newest", args)) == [
        "--policy-kwargs", '{"beta": 2.0, "victim": "newest"}']
    assert programs_http.serve_args(*bench.policy_spec("fcfs", args)) == []


def test_workload_is_seeded():
    a, b = bench.make_workload(20, 0.5, seed=3), bench.make_workload(20, 0.5, seed=3)
    assert a == b and {s.kind for s in a} <= set(bench.PROGRAMS)
    assert all(x.arrival_s < y.arrival_s for x, y in zip(a, a[1:]))


def test_policy_entries_with_overrides():
    import argparse

    import pytest

    args = argparse.Namespace(first_boundary=None, quantum=None, beta=3.0)
    assert bench.policy_spec("plas", args) == ("plas", {"beta": 3.0})  # the command-line value
    assert bench.policy_spec("plas:np:beta=2", args) == ("plas", {"beta": 2.0, "preempt": False})
    assert bench.policy_spec("mlfq", args) == ("mlfq", {})  # beta means nothing to mlfq
    assert bench.policy_spec("fcfs", args) == ("fcfs", {})
    assert bench.policy_spec("atlas:num_queues=8:order=call:live=off", args) == (
        "atlas", {"beta": 3.0, "num_queues": 8, "order": "call", "live": False})
    assert bench.policy_spec("plas:running_cap=auto", args) == ("plas", {"beta": 3.0, "running_cap": "auto"})
    assert bench.policy_spec("plas:running_cap=6", args) == ("plas", {"beta": 3.0, "running_cap": 6})
    for bad, message in [("plas:fast", "unknown policy variant 'fast'"), ("fcfs:beta=2", "nothing for fcfs"),
                         ("atlas:beta=high", "beta must be float, got 'high'"),
                         ("plas:num_queues=2.5", "num_queues must be int"),
                         ("plas:live=maybe", r"live must be a flag \(1/0, true/false\), got 'maybe'"),
                         ("mlfq:order=call", "unknown policy variant 'order=call'"),
                         ("plas:running_cap=0", "running_cap must be 'auto' or an integer >= 1, got '0'")]:
        with pytest.raises(SystemExit, match=message):
            bench.policy_spec(bad, args)


def test_react_calls_option(monkeypatch):
    import argparse

    import pytest

    from agentrt.bench import workload as wl

    monkeypatch.setitem(wl.REACT, "calls", wl.REACT["calls"])  # restored after the test
    ap = argparse.ArgumentParser()
    bench.add_common_args(ap)
    bench.setup(ap.parse_args(["--programs", "2", "--react-calls", "3"]))
    assert wl.REACT["calls"] == (3, 3)
    bench.setup(ap.parse_args(["--programs", "2", "--react-calls", "2-6"]))
    assert wl.REACT["calls"] == (2, 6)
    counts = {sum(1 for _ in _calls(wl.react_plan(__import__("random").Random(s)))) for s in range(40)}
    assert counts == {2, 3, 4, 5, 6}
    for bad in ("0", "5-2", "x", "2-"):
        with pytest.raises(SystemExit, match=f"--react-calls must be N or LO-HI .* got '{bad}'"):
            bench.setup(ap.parse_args(["--programs", "2", "--react-calls", bad]))


def test_mix_option(monkeypatch):
    import argparse

    import pytest

    from agentrt.bench import workload as wl

    monkeypatch.setattr(wl, "MIX", dict(wl.MIX))
    ap = argparse.ArgumentParser()
    bench.add_common_args(ap)
    work, _ = bench.setup(ap.parse_args(["--programs", "30", "--mix", "chat=1,tree=0"]))
    assert wl.MIX == {"chat": 1.0, "tree": 0.0} and {s.kind for s in work} == {"chat"}
    for bad in ("chat=1,poem=2", "chat=-1", "chat", "chat=0"):
        with pytest.raises(SystemExit, match=f"--mix must be KIND=WEIGHT pairs of chat, react, tree, react_few, steps .* got '{bad}'"):
            bench.setup(ap.parse_args(["--programs", "2", "--mix", bad]))


def _calls(plan):
    """The Call actions of a plan, answering each with two tokens."""
    value = None
    while True:
        try:
            action = plan.send(value)
        except StopIteration:
            return
        value = [1, 2] if not hasattr(action, "seconds") else action.observation
        if hasattr(action, "prompt"):
            yield action


def test_agent_wait_mix_plans():
    """Issue 47's mix: 2-4 sequential ReAct calls over a growing context; 8-12 steps of 4 parallel calls on one
    shared, growing conversation, a tool gap between steps."""
    from agentrt.bench import workload as wl

    for seed in range(20):
        spec = wl.ProgramSpec(0, "react_few", 0.0, seed)
        gen, value, calls, tools, prompts = wl.plan(spec), None, 0, 0, []
        while True:
            try:
                action = gen.send(value)
            except StopIteration:
                break
            if isinstance(action, wl.Call):
                calls += 1
                prompts.append(action.prompt)
                value = [7] * action.max_tokens
            else:
                tools += 1
                assert 0 < action.seconds <= wl.REACT_FEW["tool_max_s"]
                value = action.observation
        assert 2 <= calls <= 4 and tools == calls - 1
        assert all(b[: len(a)] == a and len(b) > len(a) for a, b in zip(prompts, prompts[1:]))  # context grows
        spec = wl.ProgramSpec(0, "steps", 0.0, seed)
        gen, value, steps, history = wl.plan(spec), None, 0, None
        while True:
            try:
                action = gen.send(value)
            except StopIteration:
                break
            if isinstance(action, wl.Parallel):
                steps += 1
                assert len(action.calls) == wl.STEPS["width"]
                shared = action.calls[0].prompt[:-8]
                assert all(c.prompt[:-8] == shared for c in action.calls)  # one conversation, 4 candidates
                assert history is None or shared[: len(history)] == history
                history = shared
                value = [[i] * c.max_tokens for i, c in enumerate(action.calls)]
            else:
                value = action.observation
        assert 8 <= steps <= 12


def test_http_breakdown_by_class():
    from agentrt.bench import programs_http

    def prog(kind, latency, queue):
        return {"kind": kind, "latency_s": latency, "parts": {"tools_s": 1.0, "calls_s": latency - 1.0, "queue_s": queue,
                                                              "service_s": 0.5, "recomputed_tokens": 10,
                                                              "tier_loaded_tokens": 0}}

    out = programs_http.breakdown([prog("react_few", 4.0, 1.0), prog("react_few", 6.0, 3.0), prog("steps", 20.0, 9.0)],
                                  ("steps",))
    assert out["short"]["programs"] == 2 and out["short"]["latency_s"] == 5.0 and out["short"]["queue_s"] == 2.0
    assert out["long"]["programs"] == 1 and out["long"]["calls_s"] == 19.0
    assert "| plas | short | 2 | 5.00 | 1.00 | 2.00 | 4.00 |" in programs_http.breakdown_table({"plas": {"http_breakdown": out}})
