"""Per-program state stays bounded without a runtime to end programs: the policies' program
records, the process table's histories, the engine's maps after much traffic."""

import anyio
import pytest

import agentrt.policies  # noqa: F401  (registers plas, atlas, mlfq)
from agentrt._process_table import PROGRAM_HISTORY, TOOL_HISTORY, ProcessTable, ProgramInfo
from agentrt.engine import FCFS, AsyncEngine, SamplingParams
from agentrt.engine.request import Request
from agentrt.policies import ATLAS, MLFQ, PLAS
from tests.conftest import assert_all_blocks_free


def run_call(pol, rid: str, program: str, now: float) -> None:
    req = Request(rid, [1, 2, 3], SamplingParams(), program_id=program, arrival_time=now)
    pol.on_arrival(req, now)
    pol.on_step([req], [0.1], [3], now)
    pol.on_finish(req, now)


@pytest.mark.parametrize("cls", [PLAS, ATLAS, MLFQ])
def test_idle_programs_expire_and_are_capped(cls):
    pol = cls(service="tokens")
    pol.idle_ttl_s, pol.max_idle_programs = 10.0, 3
    for i in range(5):
        run_call(pol, f"r{i}", f"p{i}", now=float(i))
    assert sorted(pol.programs) == ["p2", "p3", "p4"]  # the cap: least recently active dropped first
    run_call(pol, "again", "p2", now=5.0)  # active again: now the most recent
    live = Request("live", [1, 2, 3], SamplingParams(), program_id="busy", arrival_time=6.0)
    pol.on_arrival(live, 6.0)  # a program with a call in the engine is never dropped
    pol.before_schedule([], [live], now=14.5)  # p3, p4 idle for more than 10 s, p2 for 9.5 s
    assert sorted(pol.programs) == ["busy", "p2"]
    pol.before_schedule([], [live], now=100.0)
    assert sorted(pol.programs) == ["busy"]
    pol.on_finish(live, 101.0)
    pol.end_program("busy")
    pol.before_schedule([], [], now=102.0)
    assert pol.programs == {} and not pol._idle


def test_end_program_is_part_of_the_seam():
    FCFS().end_program("anything")  # a no-op for policies without program state


def test_engine_without_runtime_forgets_programs(tiny_model_path):
    async def main():
        async with AsyncEngine(model=str(tiny_model_path), num_blocks=64, block_size=4, policy="plas") as eng:
            pol = eng.core.policy
            pol.idle_ttl_s = 0.0
            for i in range(6):
                await eng.add_request([5, 6, 7, i + 10], SamplingParams(max_tokens=2, temperature=0),
                                      program_id=f"prog-{i}").result()
            await eng.add_request([9, 9], SamplingParams(max_tokens=2, temperature=0)).result()  # one more step
            assert pol.programs == {}
            assert not any(eng.num_tracked().values())
            assert_all_blocks_free(eng.core)

    anyio.run(main)


def test_process_table_histories_are_bounded():
    table = ProcessTable()
    info = ProgramInfo("p", "prog", None, start_time=0.0)
    table.start(info)
    for i in range(TOOL_HISTORY + 10):
        table.record_tool(info, "search", float(i))
    assert len(table.tool_durations["search"]) == TOOL_HISTORY
    first = TOOL_HISTORY + 10 - PROGRAM_HISTORY
    assert list(info.tool_durations["search"]) == [float(i) for i in range(first, TOOL_HISTORY + 10)]
    assert info.tool_durations["search"][0] == first  # still indexable like a list
    for i in range(PROGRAM_HISTORY + 5):
        call = table.call_started(info, f"r{i}", "t0", 3)
        table.call_done(info, call, service_s=0.0, wait_s=0.0, num_output_tokens=1)
    assert len(info.gaps_s) == PROGRAM_HISTORY
