"""Retention policy (agentrt._retention): Continuum's TTL choice, its defaults and overrides, and on
the engine: a ReAct-like program whose tool outlasts what the LRU prefix cache keeps, but not its TTL,
has its next call served from the pinned prefix; reservations from `@agentrt.program`; everything
released at program end."""

from __future__ import annotations

import anyio
import pytest

import agentrt
from agentrt._errors import UsageError
from agentrt._retention import RetentionConfig, RetentionPolicy, choose_ttl
from agentrt.engine import SamplingParams
from agentrt.engine.program_ops import EndProgram, Pin, Reserve, StartProgram
from tests.waiting import await_until

BS = 16


def test_choose_ttl_maximizes_expected_saving_minus_holding_time():
    # P(d <= tau) * gain - tau over {0, 0.1, 0.2, 0.3, 10}: gain 2 -> tau 0.3 (0.8 * 2 - 0.3 = 1.3)
    assert choose_ttl([0.1, 0.2, 0.2, 0.3, 10.0], 2.0) == 0.3
    assert choose_ttl([0.1, 0.2, 0.2, 0.3, 10.0], 100.0) == 10.0  # recompute dear: wait out the tail
    assert choose_ttl([5.0, 6.0], 1.0) == 0.0  # the tool outlasts any saving: do not pin
    assert choose_ttl([], 5.0) == 0.0


def test_ttl_for_falls_back_to_pooled_then_default():
    sent = []
    cfg = RetentionConfig(min_tool_samples=3, min_pooled_samples=2, default_ttl_s=1.5)
    pol = RetentionPolicy(cfg, sent.append, cache_tokens=1000)
    assert pol.ttl_for("search", 100) == 1.5  # nothing seen
    pol.s_per_token, pol.queue_delay_s = 0.01, 0.0  # reload of 100 tokens = 1 s
    pol.record_duration("calc", 0.2)
    pol.record_duration("calc", 0.4)
    assert pol.ttl_for("search", 100) == 0.4  # pooled: P=1 at 0.4 -> 1 - 0.4 beats 0.5 - 0.2
    for _ in range(3):
        pol.record_duration("search", 3.0)
    assert pol.ttl_for("search", 100) == 0.0  # its own record: 3 s tools are not worth 1 s of recompute
    assert pol.ttl_for("search", 1000) == 3.0  # ... 10 s of recompute is
    assert pol.ttl_for("calc", 200) == 0.4  # 2 samples < 3: pooled (0.2, 0.4, 3, 3, 3), gain 2 s


def test_policy_sends_ops_in_order_and_caps_reservations():
    sent = []
    pol = RetentionPolicy(RetentionConfig(auto_reserve=True, max_reserved_fraction=0.25), sent.append, cache_tokens=1000)
    pol.program_started("p", 400)  # declared above the cap: 250
    pol.program_started("q", None)
    assert sent == [StartProgram("p"), Reserve("p", 250), StartProgram("q")]
    sent.clear()
    pol.call_submitted("q", 0.0)
    pol.call_ended("q", 1.0, tokens=100, computed_tokens=100, service_s=0.1, wait_s=0.0)
    assert sent == [Pin("q", 2.0)]  # default TTL; auto reserve wants 100 but the cap has 0 left
    pol.program_ended("p")
    pol.call_submitted("q", 1.5)
    pol.call_ended("q", 2.0, tokens=160, computed_tokens=160, service_s=0.1, wait_s=0.0)
    assert sent[1:] == [EndProgram("p"), Pin("q", 2.0), Reserve("q", 220)]  # 160 + growth 60
    assert pol.pooled[-1] == 0.5 and pol.eta == 0.5


def test_decorator_arguments_are_checked():
    with pytest.raises(UsageError, match="ttl"):
        agentrt.tool(ttl=-1.0)
    with pytest.raises(UsageError, match="kv_reserve_tokens"):
        agentrt.program(kv_reserve_tokens="a lot")
    with pytest.raises(ValueError, match="max_reserved_fraction"):
        RetentionConfig(max_reserved_fraction=1.0)


async def _react_with_noise(path, retention: bool) -> dict:
    """Call 1 (96 prompt tokens), then a tool that waits while another program cycles the whole cache,
    then call 2 extending call 1's tokens: what did call 2 find?"""
    noise_done = anyio.Event()
    seen: dict = {}

    @agentrt.tool(ttl=30.0)
    async def slow_tool() -> list[int]:
        await noise_done.wait()
        return list(range(300, 308))

    @agentrt.program
    async def react() -> None:
        prompt = list(range(1000, 1096))
        rt = agentrt._context.current_runtime()
        ids = await _generate_ids(rt, prompt)
        seen["first"] = rt.program_kv(agentrt.current_program_id())
        observation = await slow_tool()
        await _generate_ids(rt, prompt + ids + observation)
        seen["second"] = rt.program_kv(agentrt.current_program_id())

    @agentrt.program
    async def noise() -> None:
        for i in range(4):  # 4 x 13 blocks through a 24-block cache: LRU keeps none of react's blocks
            await agentrt.generate(list(range(2000 + 300 * i, 2200 + 300 * i)), max_tokens=1)
        noise_done.set()

    async with agentrt.Runtime(str(path), retention=retention, num_blocks=24, max_num_seqs=2) as rt:
        async with anyio.create_task_group() as tg:
            tg.start_soon(react)
            await await_until(lambda: seen, "react's first call to end")
            tg.start_soon(noise)
        seen["stats"] = rt.kv_stats()
    return seen


async def _generate_ids(rt, prompt: list[int]) -> list[int]:
    from agentrt._program import current

    handle, thread = current()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    async with rt.submit_call(handle, thread, prompt, params, "generate", None) as call:
        return list((await call.result()).outputs[0].token_ids)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_react_next_call_is_served_from_the_pinned_prefix(tiny_model_path):
    lru = await _react_with_noise(tiny_model_path, retention=False)
    ttl = await _react_with_noise(tiny_model_path, retention=True)
    # call 2's prompt: 96 + 4 + 8 = 108 tokens; call 1 computed 96 + 3 of them: 6 full blocks (96 tokens)
    assert ttl["second"].ttl_hits == 1 and ttl["second"].ttl_misses == 0
    assert ttl["second"].recomputed_prefill_tokens == 3  # only call 1's partial last block
    # noise pins too (the default TTL), but its pins give way first: it started later
    assert ttl["stats"].ttl_hits == 4 and ttl["stats"].pin_blocks_given_way > 0
    assert lru["second"].ttl_hits == 0
    assert lru["second"].recomputed_prefill_tokens == 99  # everything call 1 had computed
    assert ttl["first"].pinned == 6 and ttl["first"].ttl_s == 2.0  # pinned at call 1's end, default TTL ...
    assert ttl["second"].ttl_s == 30.0  # ... until the tool started with its own
    assert ttl["stats"].num_pinned_blocks == 0 and ttl["stats"].num_free_blocks == 24  # ... and all free at the end


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_reservation_from_the_decorator_and_release_at_end(tiny_model_path):
    held = {}

    @agentrt.program(kv_reserve_tokens=5 * BS)
    async def reserved() -> None:
        rt = agentrt._context.current_runtime()
        await agentrt.generate(list(range(1000, 1020)), max_tokens=2)
        held["during"] = rt.program_kv(agentrt.current_program_id())

    async with agentrt.Runtime(str(tiny_model_path), num_blocks=24) as rt:
        await reserved()
        info = [p for p in rt.programs if p.name == "reserved"][0]
        assert held["during"].reserved == 5 and held["during"].pinned == 1  # 21 tokens computed: 1 full block
        assert held["during"].reserved_used == 1  # the pinned block was drawn from the reservation
        assert info.kv_reserve_tokens == 5 * BS
        assert (info.kv.held, info.kv.pinned, info.kv.reserved) == (0, 0, 0)  # ended: its record holds nothing
        stats = await await_until(lambda: (s := rt.kv_stats()).num_free_blocks == 24 and s,
                                  "every block free after the program's end", describe=rt.kv_stats)
        assert stats.num_reserved_blocks == 0 and stats.num_pinned_blocks == 0 and stats.num_free_blocks == 24


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_chat_reuses_generated_ids_for_a_stable_prefix(tiny_model_path):
    from agentrt.policies import PLAS

    prompts: list[list[int]] = []
    outputs: dict = {}

    class Recorder(PLAS):
        def on_arrival(self, req, now):
            prompts.append(list(req.prompt_token_ids))
            super().on_arrival(req, now)

    @agentrt.program
    async def two_turns() -> None:
        messages = [{"role": "user", "content": "Name three colors."}]
        reply = await agentrt.chat(messages, max_tokens=12, ignore_eos=True, temperature=1.0, seed=3)
        outputs["first"] = agentrt._context.current_runtime()._chat.convs[agentrt.current_program_id()][1]
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And three more?"}]
        await agentrt.chat(messages, max_tokens=4, ignore_eos=True)

    async with agentrt.Runtime(str(tiny_model_path), policy=Recorder()) as rt:
        await two_turns()
        assert not rt._chat.convs and not rt._chat.prompts  # dropped at the program's end
    first, second = prompts
    generated = outputs["first"][len(first):]
    assert len(generated) == 12
    assert second[: len(first) + 12] == first + generated  # the generated ids, not a re-tokenization


def test_simulator_runs_the_engine_pin_code_in_virtual_time():
    from agentrt.bench import simulate as sim
    from agentrt.bench import workload as wl

    work = wl.make_workload(16, 0.5, 3)
    engine = {"num_blocks": 48, "max_num_seqs": 4, "max_num_batched_tokens": 256}
    lru = sim.simulate("plas", work, engine=engine, retention=RetentionConfig(ttl=False))
    ttl = sim.simulate("plas", work, engine=engine, retention=RetentionConfig(ttl=True))
    # both end with every block free (simulate asserts it); TTL pins across the ReAct programs' tool gaps
    assert lru["ttl_hits"] == 0 and ttl["ttl_hits"] > 0
    assert ttl["recomputed_prefill_tokens"] < lru["recomputed_prefill_tokens"]


def test_rate_at_equal_latency_interpolates_between_swept_rates():
    from agentrt.bench.simulate import rate_at_latency

    rows = [{"config": "a", "rate": r, "latency_mean_s": lat} for r, lat in ((0.1, 50.0), (0.2, 100.0), (0.3, 400.0))]
    assert rate_at_latency(rows, "a", 75.0) == pytest.approx(0.15)
    assert rate_at_latency(rows, "a", 250.0) == pytest.approx(0.25)
    assert rate_at_latency(rows, "a", 40.0) is None and rate_at_latency(rows, "a", 500.0) is None
