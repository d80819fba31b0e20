"""`agentrt programs show ID`: a program's timeline drawn in the terminal from a server's records."""

from __future__ import annotations

import argparse

import httpx

from agentrt._timeline import CallTimes, build_timeline
from agentrt.command.programs import DECODE, GAP, PREEMPTED, PREFILL, QUEUED, bar, render, show_program
from tests.server.live import live_server, tiny_config


def test_bar_draws_each_phase_where_the_records_put_it():
    calls = [CallTimes("p-c1", "p.t0", 0.0, 2.0, 4.0, 10.0, preemptions=[[5.0, 6.0]]),
             CallTimes("p-c2", "p.t0", 15.0, 0.0, 1.0, 20.0)]
    tl = build_timeline("p", "x", "finished", 0.0, 20.0, calls, now=30.0).to_dict()
    row = bar(tl["threads"][0], 0.0, 20.0, 20)
    assert row == QUEUED * 2 + PREFILL * 2 + DECODE + PREEMPTED + DECODE * 4 + GAP * 5 + PREFILL + DECODE * 4
    assert len(render(tl, 20)) == 3


def test_show_draws_a_served_program(tiny_model_path, capsys):
    with live_server(tiny_config(tiny_model_path, db="sqlite://")) as s:
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                       headers={"X-Program-Id": "show-me"}, timeout=60)
        assert r.status_code == 200
        args = argparse.Namespace(program_id="show-me", url=s.url, api_key=None, width=40)
        assert show_program(args) == 0
        out = capsys.readouterr().out
        assert "show-me" in out and "running" in out and DECODE in out and "output tokens" in out
        args.program_id = "nope"
        try:
            show_program(args)
        except SystemExit as e:
            assert "HTTP 404" in str(e.code) and "nope" in str(e.code)
        else:
            raise AssertionError("an unknown program must fail")
