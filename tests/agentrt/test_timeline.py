"""Program timelines (issue 52, acceptance 4): over a scripted in-process run with known waits (one seat:
the branches queue), a tool gap and preemptions (a tiny pool), the timeline says exactly what the call
records say, and its totals are their sums."""

from __future__ import annotations

import anyio
import pytest

import agentrt
from agentrt._timeline import CallTimes, build_timeline
from agentrt.engine import SamplingParams

TOOL_S = 0.3


def _run(tiny_model_path, **kw):
    @agentrt.tool(name="lookup")
    async def lookup() -> None:
        await anyio.sleep(TOOL_S)

    params = dict(max_tokens=10, temperature=0.0, ignore_eos=True)

    @agentrt.program(name="scripted")
    async def scripted() -> str:
        await agentrt.generate(list(range(5, 14)), **params)
        await lookup()
        await agentrt.generate(list(range(5, 20)), **params)
        # 4 branches in a 14-block pool of 4-token blocks: they do not fit together, so some are preempted
        await agentrt.gather(*(agentrt.generate(list(range(100 + 50 * i, 110 + 50 * i + i)), **params)
                               for i in range(4)))
        return agentrt.current_program_id()

    async def go():
        async with agentrt.Runtime(str(tiny_model_path), trace=True, num_blocks=14, block_size=4, max_num_seqs=8,
                                   max_num_batched_tokens=64, **kw) as rt:
            pid = await scripted()
            return rt, pid, rt.timeline(pid), list(rt.timelines.calls[pid]), rt.kv_stats()

    return anyio.run(go)


def test_timeline_is_what_the_call_records_say(tiny_model_path):
    rt, pid, tl, records, kv = _run(tiny_model_path)
    assert tl.program_id == pid and tl.name == "scripted" and tl.state == "finished"
    by_id = {r.request_id: r for r in records}
    bars = tl.calls
    assert [b.request_id for b in bars] == sorted(by_id, key=lambda r: (by_id[r].arrival_at, r))
    assert len(bars) == 6 and len(tl.threads) == 5  # the main thread and 4 branches
    for b in bars:
        r = by_id[b.request_id]
        assert not b.running and b.state == "length"
        assert b.thread_id == r.thread_id
        assert b.arrival_at == r.arrival_at and b.end_at == r.finished_at
        assert b.scheduled_at == pytest.approx(r.arrival_at + r.queued_s, abs=1e-9)
        assert b.first_token_at == pytest.approx(r.arrival_at + r.first_token_s, abs=1e-9)
        assert b.arrival_at <= b.scheduled_at <= b.first_token_at <= b.end_at
        assert [(p.at, p.resumed_at) for p in b.preemptions] == [
            (pytest.approx(r.arrival_at + a), pytest.approx(r.arrival_at + z)) for a, z in r.preemptions or ()]
        assert (b.num_prompt_tokens, b.num_output_tokens, b.num_cached_tokens) == (
            r.num_prompt_tokens, r.num_output_tokens, r.num_cached_tokens)
        assert b.pin_until == (pytest.approx(r.finished_at + r.pin_ttl_s) if r.pin_ttl_s else None)
    # the tool gap: on the main thread, between its first two calls, named by the tool, as long as it ran
    main = tl.threads[0]
    assert [c.request_id for c in main.calls] == [f"{pid}-c1", f"{pid}-c2"]
    (gap,) = main.gaps
    assert gap.tool == "lookup" and main.calls[1].tool == "lookup"
    assert (gap.start_at, gap.end_at) == (main.calls[0].end_at, main.calls[1].arrival_at)
    assert TOOL_S <= gap.end_at - gap.start_at < TOOL_S + 0.5
    # preemptions happened, and the timeline marks every one
    assert kv.num_preemptions > 0
    assert max(r.queued_s for r in records) > 0  # some call waited for room
    t = tl.totals
    assert t.num_preemptions == kv.num_preemptions == sum(len(r.preemptions or ()) for r in records)
    # the totals are the records' sums
    assert t.calls == 6 and t.calls_in_flight == 0
    assert t.num_output_tokens == sum(r.num_output_tokens for r in records) == 60
    assert t.num_prompt_tokens == sum(r.num_prompt_tokens for r in records)
    assert t.queued_s == pytest.approx(sum(r.queued_s for r in records), abs=1e-5)  # epoch-time rounding
    assert t.prefill_s == pytest.approx(sum(r.first_token_s - r.queued_s for r in records), abs=1e-5)
    assert t.decode_s == pytest.approx(sum(r.finished_at - r.arrival_at - r.first_token_s for r in records), abs=1e-5)
    assert t.tool_s == pytest.approx(gap.end_at - gap.start_at)
    assert t.service_s == pytest.approx(sum(r.service_s for r in records))
    info = rt.programs[pid]
    assert t.service_s == pytest.approx(info.service_s) and t.num_output_tokens == info.num_output_tokens
    assert tl.to_dict()["totals"]["calls"] == 6


def test_a_waiting_call_is_queued_then_prefill_then_decode():
    now = 100.0
    calls = [CallTimes("p-c1", "p.t0", 90.0, None, None, None),  # still queued
             CallTimes("p-c2", "p.t1", 91.0, 2.0, None, None),  # scheduled at 93, no token yet
             CallTimes("p-c3", "p.t2", 92.0, 1.0, 3.0, None)]  # decoding since 95
    tl = build_timeline("p", "x", "running", 89.0, None, calls, now=now)
    assert [c.state for c in tl.calls] == ["queued", "prefill", "decode"]
    assert [(c.scheduled_at, c.first_token_at, c.end_at) for c in tl.calls] == [
        (None, None, now), (93.0, None, now), (93.0, 95.0, now)]
    assert tl.totals.queued_s == 10.0 + 2.0 + 1.0 and tl.totals.prefill_s == 7.0 + 2.0
    assert tl.totals.decode_s == 5.0 and tl.totals.calls_in_flight == 3 and tl.totals.wall_s == 11.0


def test_timeline_needs_trace(tiny_model_path):
    async def go():
        async with agentrt.Runtime(str(tiny_model_path), num_blocks=16) as rt:
            info = rt.start_program(name="p")
            with pytest.raises(agentrt.UsageError, match="trace=True"):
                rt.timeline(info.program_id)

    anyio.run(go)
    with pytest.raises(agentrt.ConfigError, match="trace must be"):
        agentrt.Runtime(trace="ftp://x")
