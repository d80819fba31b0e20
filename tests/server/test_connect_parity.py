"""One program, in-process and through `agentrt.connect`: the same arguments accepted (the model by the name
`agentrt serve` gives it, or its path), the same records in the process table (calls, tokens, threads; the
service the server measured), the same thread count: the threads that made calls, so a `gather` of 3 branches
is 3 threads, and 4 when the program's main thread called too."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

import agentrt
from tests.server.conftest import check_idle
from tests.server.live import live_server, tiny_config

SAME = ("name", "state", "calls_done", "calls_waiting", "calls_running", "num_prompt_tokens", "num_output_tokens",
        "num_threads")
GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv(tiny_model_path):
    with live_server(tiny_config(tiny_model_path)) as s:  # no served name: the model directory's, as in-process
        yield s
        check_idle(s)


@agentrt.program(name="fan_out")
async def fan_out(model: str | None) -> str:
    """Three branches, the main thread making no call."""
    await agentrt.gather(*(agentrt.chat([{"role": "user", "content": f"branch {i}"}], model=model, **GREEDY)
                           for i in range(3)))
    return agentrt.current_program_id()


@agentrt.program(name="planner")
async def planner(model: str | None) -> tuple[str, str]:
    """A call of the main thread, a 3-branch fan-out (a nested program), 3 steps in parallel, a stream."""
    plan = await agentrt.chat([{"role": "user", "content": "plan"}], model=model, **GREEDY)
    child = await fan_out(model)
    await agentrt.gather(*(agentrt.generate(f"step {i} of {plan}", model=model, **GREEDY) for i in range(3)))
    "".join([t async for t in agentrt.chat_stream([{"role": "user", "content": "more"}], model=model, **GREEDY)])
    return agentrt.current_program_id(), child


async def run_both(model: str | None) -> tuple[list[agentrt.ProgramInfo], str]:
    pid, child = await planner(model)
    table = agentrt.process_table()
    return [table[pid], table[child]], pid


def test_one_program_same_records_and_model_names_both_ways(srv, tiny_model_path):
    name = Path(tiny_model_path).name  # what `agentrt serve <path>` serves it as
    assert srv.state.model_name == name

    async def in_process():
        async with agentrt.Runtime(str(tiny_model_path), num_blocks=64) as rt:
            assert rt.model_names == (name, str(tiny_model_path))
            got = [await run_both(m) for m in (None, name, str(tiny_model_path))]
            with pytest.raises(agentrt.InvalidCallError, match=f"'other' is neither the model '{name}'") as err:
                await agentrt.chat([{"role": "user", "content": "x"}], model="other", max_tokens=1)
            assert err.value.param == "model"
            return got

    async def remote():
        async with agentrt.connect(srv.url):
            got = [await run_both(m) for m in (None, name, str(tiny_model_path))]
            with pytest.raises(agentrt.InvalidCallError, match="'other' does not exist") as err:
                await agentrt.chat([{"role": "user", "content": "x"}], model="other", max_tokens=1)
            assert err.value.param == "model"
            return got

    local, over_http = anyio.run(in_process), anyio.run(remote)
    for (here, _), (there, pid) in zip(local, over_http):
        for a, b in zip(here, there):
            assert {f: getattr(a, f) for f in SAME} == {f: getattr(b, f) for f in SAME}
            for info in (a, b):
                assert info.service_s > 0 and 0 < info.critical_path_s <= info.service_s + 1e-9 and info.wait_s >= 0
        planner_info, fan_out_info = there
        assert (planner_info.calls_done, planner_info.num_threads) == (5, 4)  # main + 3 steps (the stream on main)
        assert (fan_out_info.calls_done, fan_out_info.num_threads) == (3, 3)  # 3 branches; its main never called
        assert fan_out_info.parent_id == planner_info.program_id
        served = srv.state.runtime.programs[pid]  # the client's copy is the server's record, exactly
        assert {f: getattr(served, f) for f in (*SAME[2:], "service_s", "critical_path_s", "wait_s")} == \
            {f: getattr(planner_info, f) for f in (*SAME[2:], "service_s", "critical_path_s", "wait_s")}


@agentrt.program(name="watcher")
async def watcher() -> tuple[int, float]:
    """The program's own record while it runs, after two calls."""
    await agentrt.chat([{"role": "user", "content": "one"}], **GREEDY)
    await agentrt.chat([{"role": "user", "content": "two"}], **GREEDY)
    info = agentrt.process_table()[agentrt.current_program_id()]
    with anyio.fail_after(10):  # through connect the record comes back from the server just after the call
        while info.calls_done < 2:
            await anyio.sleep(0.01)
    return info.calls_done, info.service_s


def test_a_running_programs_record_follows_its_calls_both_ways(srv, tiny_model_path):
    async def in_process():
        async with agentrt.Runtime(str(tiny_model_path), num_blocks=64):
            return await watcher()

    async def remote():
        async with agentrt.connect(srv.url):
            return await watcher()

    for calls, service in (anyio.run(in_process), anyio.run(remote)):
        assert calls == 2 and service > 0
