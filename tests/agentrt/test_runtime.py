"""Program identity, the process table, tools, streaming and errors, on the tiny random model."""

from __future__ import annotations

from typing import Literal

import anyio
import pytest

import agentrt
from agentrt.engine.request import Request
from agentrt.policies import PLAS
from tests.waiting import await_until

pytestmark = pytest.mark.anyio

MSG = [{"role": "user", "content": "hello"}]


class Recorder(PLAS):
    """PLAS that remembers (request id, program id, thread id) of every call the engine sees."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen: list[tuple[str, str | None, str | None]] = []

    def on_arrival(self, req: Request, now: float) -> None:
        self.seen.append((req.request_id, req.program_id, req.thread_id))
        super().on_arrival(req, now)


def runtime(path, **kw) -> agentrt.Runtime:
    kw = {"num_blocks": 64, "max_num_seqs": 8, **kw}
    return agentrt.Runtime(str(path), **kw)


def test_public_names_match_all():
    import inspect

    public = {n for n in dir(agentrt) if not n.startswith("_") and not inspect.ismodule(getattr(agentrt, n))}
    assert sorted(agentrt.__all__) == agentrt.__all__
    assert set(agentrt.__all__) == public
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        agentrt.nope


async def test_nested_programs_carry_their_own_ids(tiny_model_path):
    rec = Recorder()
    ids = {}

    @agentrt.program(name="inner")
    async def inner() -> str:
        ids["inner"] = agentrt.current_program_id()
        return await agentrt.generate("inner", max_tokens=2)

    @agentrt.program
    async def outer() -> str:
        ids["outer"] = agentrt.current_program_id()
        await agentrt.generate("before", max_tokens=2)
        await inner()
        return await agentrt.generate("after", max_tokens=2)

    async with runtime(tiny_model_path, policy=rec) as rt:
        await outer()
        programs = [rec.seen[i][1] for i in range(3)]
        assert programs == [ids["outer"], ids["inner"], ids["outer"]]
        o, i = rt.programs[ids["outer"]], rt.programs[ids["inner"]]
        assert (o.name, o.parent_id, o.children, o.state, o.calls_done) == ("outer", None, [ids["inner"]], "finished", 2)
        assert (i.name, i.parent_id, i.state, i.calls_done) == ("inner", ids["outer"], "finished", 1)
        assert agentrt.process_table() is rt.programs
        assert agentrt.current_program_id() is None


async def test_parallel_branches_are_threads_of_one_program(tiny_model_path):
    rec = Recorder()

    @agentrt.program
    async def fan_out() -> str:
        await agentrt.generate("root", max_tokens=2)
        await agentrt.gather(*(agentrt.generate(f"branch {i}", max_tokens=2) for i in range(3)))
        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(lambda i=i: agentrt.generate(f"tg {i}", max_tokens=2))
        await agentrt.generate("again", max_tokens=2)
        return agentrt.current_program_id()

    async with runtime(tiny_model_path, policy=rec) as rt:
        pid = await fan_out()
        assert {p for _, p, _ in rec.seen} == {pid}
        threads = [t for _, _, t in rec.seen]
        assert threads[0] == threads[-1] == f"{pid}.t0"
        assert len(set(threads[1:4])) == 3 and len(set(threads[4:6])) == 2
        assert len(set(threads)) == 6 and rt.programs[pid].num_threads == 6
        assert rt.programs[pid].calls_done == 7


async def test_call_outside_a_program_is_a_one_call_program(tiny_model_path):
    rec = Recorder()
    async with runtime(tiny_model_path, policy=rec) as rt:
        text = await agentrt.chat(MSG, max_tokens=3, temperature=0)
        assert isinstance(text, str)
        (info,) = list(rt.programs)
        assert (info.name, info.state, info.calls_done, info.parent_id) == ("chat", "finished", 1, None)
        assert rec.seen[0][1] == info.program_id and rec.seen[0][2] == f"{info.program_id}.t0"
        assert info.num_output_tokens == 3 and info.service_s > 0 and info.latency_s > 0


async def test_runtime_takes_its_config(tiny_model_path):
    config = agentrt.RuntimeConfig(str(tiny_model_path), "fcfs", engine={"num_blocks": 64, "max_num_seqs": 4},
                                   program_idle_timeout_s=5.0)
    async with agentrt.Runtime(config) as rt:
        assert rt.config is config and rt.program_idle_timeout_s == 5.0 and rt.engine_info.num_blocks == 64
        assert isinstance(await agentrt.generate("hi", max_tokens=2), str)
    with pytest.raises(agentrt.ConfigError, match="not both"):
        agentrt.Runtime(config, num_blocks=8)
    with pytest.raises(ValueError, match="program_idle_timeout_s must be a positive number of seconds, got -1"):
        agentrt.RuntimeConfig(program_idle_timeout_s=-1)


async def test_max_completion_tokens_is_openais_name_for_max_tokens(tiny_model_path):
    async with runtime(tiny_model_path):
        r = await agentrt.chat(MSG, max_completion_tokens=3, temperature=0, ignore_eos=True, full=True)
        assert len(r.choices[0].token_ids) == 3
        r = await agentrt.chat(MSG, max_tokens=9, max_completion_tokens=2, ignore_eos=True, full=True)
        assert len(r.choices[0].token_ids) == 2  # the newer name wins, as on the server
        with pytest.raises(agentrt.InvalidCallError, match="max_tokens"):
            await agentrt.chat(MSG, max_completion_tokens=0)


async def test_stream_yields_the_same_text(tiny_model_path):
    async with runtime(tiny_model_path):
        full = await agentrt.chat(MSG, max_tokens=12, temperature=0, ignore_eos=True)
        parts = [d async for d in agentrt.chat_stream(MSG, max_tokens=12, temperature=0, ignore_eos=True)]
        assert len(parts) > 1 and "".join(parts) == full
        parts = [d async for d in agentrt.generate_stream("abc", max_tokens=6, temperature=0, ignore_eos=True)]
        assert "".join(parts) == await agentrt.generate("abc", max_tokens=6, temperature=0, ignore_eos=True)


async def test_tools_and_gaps_are_recorded(tiny_model_path):
    @agentrt.tool
    async def lookup(q: str) -> str:
        await anyio.sleep(0.05)
        return q

    @agentrt.tool(name="calc")
    async def calculator() -> int:
        raise ZeroDivisionError

    @agentrt.program
    async def agent() -> str:
        await agentrt.generate("q", max_tokens=2)
        await lookup("x")
        with pytest.raises(ZeroDivisionError):
            await calculator()
        await agentrt.generate("r", max_tokens=2)
        return agentrt.current_program_id()

    async with runtime(tiny_model_path) as rt:
        info = rt.programs[await agent()]
        assert list(info.tool_durations) == ["lookup", "calc"]
        assert 0.05 <= info.tool_durations["lookup"][0] < 1.0
        assert len(info.gaps_s) == 1 and info.gaps_s[0] >= 0.05
        assert rt.programs.tool_durations["lookup"] == info.tool_durations["lookup"]
        assert info.last_call_completion >= info.last_call_arrival


async def test_failing_program_releases_everything(tiny_model_path):
    @agentrt.program
    async def boom() -> None:
        async def long_call() -> None:
            await agentrt.generate("long " * 20, max_tokens=200, ignore_eos=True)

        async def fail() -> None:
            while agentrt.process_table()[pid].calls_running < 1:
                await anyio.sleep(0.005)
            raise RuntimeError("tool broke")

        pid = agentrt.current_program_id()
        await agentrt.gather(long_call(), long_call(), fail())

    async with runtime(tiny_model_path, num_blocks=32) as rt:
        with pytest.raises(RuntimeError, match="tool broke"):
            await boom()
        (info,) = list(rt.programs)
        assert (info.state, info.error, info.calls_active, info.calls_done) == ("failed", "RuntimeError('tool broke')", 0, 2)
        assert info.num_output_tokens < 400
        # the engine applies aborts between steps
        def released() -> bool:
            stats = rt.kv_stats()
            return stats.num_free_blocks == stats.num_blocks and rt.engine.core.requests == {}

        await await_until(released, "the aborted calls to leave the engine and free their blocks",
                          describe=lambda: (list(rt.engine.core.requests), rt.kv_stats()))
        stats = rt.kv_stats()
        assert stats.num_free_blocks == stats.num_blocks
        assert rt.engine.core.requests == {} and rt.program_manager.inflight == {}


async def test_cancelled_program_ends_cancelled(tiny_model_path):
    @agentrt.program(name="slow")
    async def slow() -> None:
        await agentrt.generate("x", max_tokens=1000, ignore_eos=True)

    async with runtime(tiny_model_path) as rt:
        with anyio.move_on_after(0.3):
            await slow()
        (info,) = list(rt.programs)
        assert (info.state, info.calls_active) == ("cancelled", 0)
        await await_until(lambda: rt.kv_stats().num_free_blocks == rt.kv_stats().num_blocks,
                          "the cancelled call's blocks to be freed", describe=rt.kv_stats)


async def test_errors_name_the_value_and_program(tiny_model_path):
    with pytest.raises(agentrt.NoRuntimeError):
        await agentrt.chat(MSG)
    with pytest.raises(agentrt.ConfigError, match="'nope'"):
        agentrt.Runtime(str(tiny_model_path), policy="nope")
    with pytest.raises(agentrt.ConfigError, match="max_num_seqs"):
        agentrt.Runtime(str(tiny_model_path), max_num_seqs=0)
    with pytest.raises(agentrt.UsageError):
        agentrt.tool(lambda: 1)

    @agentrt.program
    async def bad() -> None:
        await agentrt.generate("x", max_tokens=0)

    async with runtime(tiny_model_path) as rt:
        with pytest.raises(agentrt.InvalidCallError, match=r"max_tokens.*program='prog-") as err:
            await bad()
        assert err.value.program_id == list(rt.programs)[0].program_id
        with pytest.raises(agentrt.InvalidCallError, match="messages"):
            await agentrt.chat("hello")
        with pytest.raises(agentrt.InvalidCallError, match="'content'"):
            await agentrt.chat([{"role": "user"}])
        with pytest.raises(agentrt.ProgramNotFoundError, match="'prog-none'"):
            rt.programs["prog-none"]
        with pytest.raises(agentrt.InvalidCallError, match=r"65 KV blocks.*max_tokens=1"):  # refused before the engine
            await agentrt.generate(list(range(100, 100 + 64 * 16 + 1)), max_tokens=1)
        assert isinstance(agentrt.CallFailedError("x"), agentrt.AgentrtError)


def test_run_entry_point(tiny_model_path):
    @agentrt.program
    async def hello(n: int) -> int:
        return len(await agentrt.generate("hi", max_tokens=n, ignore_eos=True)) >= 0 and n

    assert agentrt.run(hello, 3, model=str(tiny_model_path), num_blocks=32) == 3


async def test_a_conversation_with_tool_calls_continues_without_tools(tiny_model_path):
    """`reply.message()` (content None, tool_calls) and tool results go back into a plain chat."""

    @agentrt.tool
    async def lookup(key: Literal["k", "j"]) -> str:  # an enum: a random model's call ends quickly
        """Look a key up."""
        return f"value of {key}"

    async with runtime(tiny_model_path):
        msgs = [{"role": "user", "content": "look up k"}]
        reply = await agentrt.chat(msgs, tools=[lookup], tool_choice="required", max_tokens=64, temperature=0)
        assert reply.tool_calls and reply.message()["content"] is None
        msgs += [reply.message(), *await agentrt.run_tool_calls(reply.tool_calls, [lookup])]
        assert msgs[-1]["content"].startswith("value of")
        text = await agentrt.chat(msgs, max_tokens=3, temperature=0)
        streamed = "".join([t async for t in agentrt.chat_stream(msgs, max_tokens=3, temperature=0)])
        assert isinstance(text, str) and text == streamed
