"""vLLM's reset_prefix_cache: cached blocks no one holds are forgotten (no later request hits them, they
move to the free queue's head), blocks in use (a running request's, a program's pin) keep their hashes;
the answer says whether nothing cached is left. Exact state on a tiny pool, then through the engine,
and through AsyncEngine while it steps (the reset waits for the step to end)."""

import anyio

from agentrt.engine import LLM, AsyncEngine, SamplingParams
from agentrt.engine.program_ops import Pin, StartProgram
from agentrt.engine.request import Request
from tests.conftest import assert_all_blocks_free
from tests.engine.test_kv_cache_manager import P10, admit, assert_consistent, free_queue, hashes_of, make_kv, make_req


def test_reset_forgets_free_cached_blocks_and_keeps_those_in_use():
    kv = make_kv()
    a, b = make_req("a", P10), make_req("b", range(200, 208))
    admit(kv, a)
    admit(kv, b)
    assert a.block_ids == [0, 1, 2] and b.block_ids == [3, 4]
    kv.free(a)
    assert free_queue(kv) == [2, 5, 6, 7, 8, 9, 1, 0]
    assert kv.reset_prefix_cache() is False  # b's blocks are in use: they stay cached
    assert kv.pool.cached == dict(zip(hashes_of(kv, range(200, 208), 2), [3, 4]))
    assert free_queue(kv) == [1, 0, 2, 5, 6, 7, 8, 9]  # nothing to lose now: next victims
    assert kv.get_computed_blocks(make_req("a2", P10)) == ([], 0)
    assert kv.get_computed_blocks(make_req("b2", range(200, 208))) == ([3], 4)
    assert_consistent(kv, b)
    kv.free(b)
    assert kv.reset_prefix_cache() is True
    assert kv.pool.cached == {} and all(h is None for h in kv.pool.block_hash)
    assert free_queue(kv) == [4, 3, 1, 0, 2, 5, 6, 7, 8, 9]
    assert kv.stats.evictions == 0  # forgetting is not evicting
    assert_consistent(kv)


def test_reset_keeps_a_programs_pinned_blocks():
    kv = make_kv()
    kv.program_op(StartProgram("p"), 0.0)
    kv.program_op(Pin("p", 60.0), 0.0)
    a = Request("a", list(P10), SamplingParams(max_tokens=4), program_id="p")
    admit(kv, a)
    kv.free(a, now=0.0)  # blocks 0 and 1 stay pinned
    assert kv.reset_prefix_cache() is False
    assert kv.get_computed_blocks(make_req("a2", P10)) == ([0, 1], 8)


def test_engine_repeat_hits_until_reset(tiny_model_path):
    llm = LLM(str(tiny_model_path), num_blocks=64, block_size=4)
    prompt = list(range(300, 318))  # 18 tokens: 4 full blocks
    p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    first = llm.generate([prompt], p)[0]
    again = llm.generate([prompt], p)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 16
    assert llm.core.reset_prefix_cache() is True
    cold = llm.generate([prompt], p)[0]
    assert cold.num_cached_tokens == 0 and cold.token_ids == first.token_ids
    assert_all_blocks_free(llm.core)


def test_async_reset_during_a_step_waits_for_it_and_spares_running_blocks(tiny_model_path):
    prompt = list(range(400, 418))
    p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def main():
        async with AsyncEngine(model=str(tiny_model_path), num_blocks=64, block_size=4) as eng:
            long = eng.add_request(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
            async for _ in long:  # the first token: the prompt's blocks are cached, and in use
                break
            assert eng._stepping  # the engine steps on: the reset is queued behind the step
            assert await eng.reset_prefix_cache() is False
            await long.result()
            assert (await eng.add_request(prompt, p).result()).num_cached_tokens == 16  # they stayed
            assert await eng.reset_prefix_cache() is True  # idle: applied at once
            assert (await eng.add_request(prompt, p).result()).num_cached_tokens == 0
            assert_all_blocks_free(eng.core)

    anyio.run(main)
