"""Program-level scheduling end to end on the tiny random model, with contention (few seats).

Service is counted in tokens (deterministic); waits are wall time, so `beta` is in seconds per token.
"""

from __future__ import annotations

import time

import anyio
import pytest

import agentrt

pytestmark = pytest.mark.anyio

# queues [0, 64) [64, 128) ...; quantum 32 tokens in queue 0: a short call (~15 tokens) never leaves it
TOKENS = {"service": "tokens", "first_boundary": 64, "quantum": 32}


def runtime(path, policy: str, max_num_seqs: int, **policy_kwargs) -> agentrt.Runtime:
    kwargs = TOKENS | policy_kwargs if policy != "fcfs" else None
    return agentrt.Runtime(str(path), policy=policy, policy_kwargs=kwargs, num_blocks=256, max_num_seqs=max_num_seqs)


@agentrt.program(name="short")
async def short(i: int) -> float:
    await agentrt.generate(f"short {i}", max_tokens=8, ignore_eos=True)
    return time.monotonic()


async def wait_until(cond, timeout_s: float = 30.0) -> None:
    with anyio.fail_after(timeout_s):
        while not cond():
            await anyio.sleep(0.002)


@pytest.mark.parametrize("policy, seats, cap", [("fcfs", 2, None), ("plas", 2, None), ("atlas", 2, None),
                                                ("plas", 8, 2), ("plas+ttl", 8, 2)])
async def test_short_programs_overtake_a_long_one(tiny_model_path, policy, seats, cap):
    """A long program (two sequential calls, then a fan-out of two long calls) holds both seats when
    three one-call programs arrive. FCFS makes them wait for the long calls; PLAS and ATLAS see that
    the long program already had its share and let the short ones through first. With 8 seats and a
    running-set cap of 2 (`running_cap`) the same happens (plas+ttl displaces too, with `preempt`)."""

    @agentrt.program(name="long")
    async def long_program() -> float:
        for i in range(2):
            await agentrt.generate(f"step {i}", max_tokens=40, ignore_eos=True)
        await agentrt.gather(*(agentrt.generate(f"branch {b}", max_tokens=200, ignore_eos=True) for b in range(2)))
        return time.monotonic()

    ends: dict[str, float | list[float]] = {}

    async def run_long() -> None:
        ends["long"] = await long_program()

    async def run_shorts() -> None:
        ends["short"] = list(await agentrt.gather(*(short(i) for i in range(3))))

    extra = {} if cap is None else {"running_cap": cap, "preempt": True}
    widest = [0]  # the engine's running set at its widest once the short programs came

    async with runtime(tiny_model_path, policy, max_num_seqs=seats, **extra) as rt:
        scheduler = rt._engine().core.scheduler

        async def watch() -> None:
            while "short" not in ends:
                widest[0] = max(widest[0], len(scheduler.running))
                await anyio.sleep(0.001)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_long)
            await wait_until(lambda: any(p.calls_done == 2 and p.calls_running == 2 for p in rt.programs))
            tg.start_soon(watch)
            tg.start_soon(run_shorts)
        long_info = next(p for p in rt.programs if p.name == "long")
        assert long_info.calls_done == 4 and long_info.num_output_tokens == 480
    if policy == "fcfs":
        assert ends["long"] < min(ends["short"])
    else:
        assert max(ends["short"]) < ends["long"]
    assert widest[0] <= (cap or seats)  # 2 long branches + 3 short calls would be 5 wide without the cap


@pytest.mark.parametrize("beta, starves", [(0.002, False), (float("inf"), True)])
async def test_anti_starvation_under_a_stream_of_short_programs(tiny_model_path, beta, starves):
    """One seat; three feeders keep a fresh short program always waiting. Without anti-starvation the
    long program's later calls (a lower queue) wait until the stream stops; with `beta` they are
    promoted and the long program finishes while the stream still flows."""
    stream_s = 15.0 if not starves else 3.0
    state = {"stop": False, "long_end": None, "stream_end": None, "shorts": 0}

    @agentrt.program(name="long")
    async def long_program() -> None:
        for i in range(3):
            await agentrt.generate(f"step {i}", max_tokens=80, ignore_eos=True)
        state["long_end"] = time.monotonic()

    async def feeder(deadline: float) -> None:
        while state["long_end"] is None and time.monotonic() < deadline:
            await short(state["shorts"])
            state["shorts"] += 1
        state["stream_end"] = time.monotonic()

    async with runtime(tiny_model_path, "plas", max_num_seqs=1, beta=beta) as rt:
        async with anyio.create_task_group() as tg:
            tg.start_soon(long_program)
            await wait_until(lambda: any(p.calls_done == 1 for p in rt.programs))
            deadline = time.monotonic() + stream_s
            for _ in range(3):
                tg.start_soon(feeder, deadline)
        (long_info,) = [p for p in rt.programs if p.name == "long"]
        assert long_info.state == "finished" and long_info.calls_done == 3
        assert state["shorts"] >= 3
    if starves:
        assert state["long_end"] > state["stream_end"]
    else:
        assert state["long_end"] <= state["stream_end"] < deadline
        rt.policy.before_schedule([], [], time.monotonic())  # the engine is idle: drain the ended programs
        assert rt.policy.programs == {}  # every program ended and was forgotten
