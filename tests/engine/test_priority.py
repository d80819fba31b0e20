"""Priority classes (vLLM's request `priority`, SamplingParams.priority: smaller first) over every
policy: admission, the order of the running batch, preemption victims and displacement of running
requests follow the class first and the policy within a class. Exact state on tiny pools, then the
engine and the runtime end to end."""

from __future__ import annotations

import anyio
import pytest

import agentrt
from agentrt.engine import LLM, SamplingParams
from agentrt.engine.config import EngineConfig
from agentrt.engine.kv_cache_manager import KVCacheManager
from agentrt.engine.policy import FCFS
from agentrt.engine.request import Request, RequestStatus
from agentrt.engine.scheduler import Scheduler
from agentrt.policies import PLAS
from tests.conftest import assert_all_blocks_free
from tests.engine.test_kv_retention import BS, run_step

POLICIES = [FCFS, lambda: PLAS(num_queues=4)]


def make_req(rid: str, n: int, priority: int = 0, arrival: float = 0.0, max_tokens: int = 4,
             program: str | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, priority=priority)
    start = 100 + 1000 * (sum(map(ord, rid)) % 40)  # distinct prompts: no block is shared by content
    return Request(rid, list(range(start, start + n)), params, program_id=program or rid, arrival_time=arrival)


def make_scheduler(num_blocks: int, policy, **kw) -> Scheduler:
    cfg = EngineConfig(block_size=BS, num_blocks=num_blocks, device="cpu", **kw)
    return Scheduler(cfg, KVCacheManager(num_blocks, BS), policy, clock=lambda: 0.0)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_smaller_class_is_admitted_first(policy):
    s = make_scheduler(64, policy(), max_num_seqs=1)
    early = make_req("early", 4, priority=1, arrival=0.0)
    late = make_req("late", 4, priority=-1, arrival=5.0)
    s.add_request(early)
    s.add_request(late)
    assert [r.request_id for r in s.schedule().reqs] == ["late"]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_smaller_class_displaces_a_running_request_when_there_is_no_seat(policy):
    s = make_scheduler(64, policy(), max_num_seqs=1)
    low = make_req("low", 4, priority=5, max_tokens=8)
    s.add_request(low)
    run_step(s)
    assert s.running == [low]
    urgent = make_req("urgent", 4, priority=0, arrival=1.0)
    s.add_request(urgent)
    out = run_step(s)
    assert out.preempted == [low] and out.reqs == [urgent]
    while s.has_work():
        run_step(s)
    assert low.status == urgent.status == RequestStatus.FINISHED_LENGTH
    assert low.num_preemptions == 1 and urgent.num_preemptions == 0
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_same_class_keeps_the_policys_rule():
    """FCFS is not preemptive: within a class a later arrival waits for a seat."""
    s = make_scheduler(64, FCFS(), max_num_seqs=1)
    first = make_req("first", 4, priority=2, max_tokens=8)
    s.add_request(first)
    run_step(s)
    s.add_request(make_req("second", 4, priority=2, arrival=1.0))
    out = run_step(s)
    assert out.reqs == [first] and not out.preempted


@pytest.mark.parametrize("policy", POLICIES)
def test_blocks_run_out_the_largest_class_is_the_victim(policy):
    # 6 blocks of 4: three requests of 4 prompt tokens hold one block each and grow; when blocks run out
    # the victim is the one in the largest class, whatever its arrival or service (then c, once only a and
    # c are left and they no longer fit together)
    s = make_scheduler(6, policy(), max_num_batched_tokens=64)
    reqs = [make_req("a", 4, priority=0, arrival=2.0, max_tokens=12), make_req("b", 4, priority=3, arrival=0.0, max_tokens=12),
            make_req("c", 4, priority=1, arrival=1.0, max_tokens=12)]
    for r in reqs:
        s.add_request(r)
    preempted = []
    while s.has_work():
        preempted += [r.request_id for r in run_step(s).preempted]
    assert preempted[0] == "b" and "a" not in preempted  # the largest class first; class 0 never
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_priority_is_checked():
    with pytest.raises(ValueError, match="priority"):
        SamplingParams(priority=2**40)
    with pytest.raises(TypeError, match="priority"):
        SamplingParams(priority=1.5)


def test_engine_serves_the_smaller_class_first(tiny_model_path):
    llm = LLM(str(tiny_model_path), num_blocks=64, block_size=4, max_num_seqs=1)
    outs = llm.generate([[1, 2, 3], [4, 5, 6], [7, 8, 9]],
                        [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, priority=p) for p in (2, 0, 1)])
    firsts = sorted(range(3), key=lambda i: outs[i].metrics.first_token_time)
    assert firsts == [1, 2, 0]
    # vLLM's form: one SamplingParams, a priority per prompt
    outs = llm.generate([[1, 2, 3], [4, 5, 6], [7, 8, 9]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                        priority=[0, 2, 1])
    assert sorted(range(3), key=lambda i: outs[i].metrics.first_token_time) == [0, 2, 1]
    assert_all_blocks_free(llm.core)


def test_runtime_calls_take_a_priority(tiny_model_path):
    """In-process, `priority` goes with the sampling arguments: with one seat, the urgent call submitted
    last is served first."""
    order: list[str] = []

    async def call(name: str, priority: int) -> None:
        await agentrt.generate([1, 2, 3], max_tokens=2, temperature=0, ignore_eos=True, priority=priority)
        order.append(name)

    async def main():
        async with agentrt.Runtime(model=str(tiny_model_path), policy="plas", num_blocks=64, max_num_seqs=1):
            async with anyio.create_task_group() as tg:
                for name, prio in (("a", 1), ("b", 1), ("urgent", -1)):
                    tg.start_soon(call, name, prio)
                    await anyio.sleep(0)

    anyio.run(main)
    assert order.index("urgent") < order.index("b")


def test_a_programs_priority_is_its_calls_class(tiny_model_path):
    """`@agentrt.program(priority=...)`: its calls run in its class (a call's own non-zero priority wins);
    a program it calls inherits the class; a bad value is refused where the program is declared."""
    seen: list[tuple[str, int]] = []

    @agentrt.program(priority=-2)
    async def urgent():
        await agentrt.generate([1, 2, 3], max_tokens=1, temperature=0)
        await agentrt.generate([1, 2, 3], max_tokens=1, temperature=0, priority=4)
        await helper()

    @agentrt.program
    async def helper():
        await agentrt.generate([1, 2, 3], max_tokens=1, temperature=0)

    async def main():
        async with agentrt.Runtime(model=str(tiny_model_path), num_blocks=64) as rt:
            add = rt.engine.add_request

            def spy(prompt, params, **kw):
                seen.append((kw["program_id"], params.priority))
                return add(prompt, params, **kw)

            rt.engine.add_request = spy
            await urgent()
            await helper()

    anyio.run(main)
    assert [p for _, p in seen] == [-2, 4, -2, 0]
    assert seen[2][0] != seen[0][0]  # the helper ran as a program of its own, in its caller's class
    with pytest.raises(TypeError, match="priority"):
        agentrt.program(priority="high")
    with pytest.raises(TypeError, match="priority"):
        agentrt.program(priority=2**40)
