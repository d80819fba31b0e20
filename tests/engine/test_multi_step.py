"""Multi-step decode (EngineConfig.num_scheduler_steps): greedy decode rows run several steps per
scheduler call, token-for-token equal to one step per call, only where nothing but the argmax is needed."""

import os

import pytest
import torch

from agentrt.engine import LLM, EngineConfig, SamplingParams
from tests.conftest import assert_all_blocks_free


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A 2-layer random Llama with head_dim 32: the C++ kernels' decode path (`decode_steps`) takes it
    (the shared tiny model's head_dim 16 runs the model's Python loop, tested against it below)."""
    from agentrt.engine.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-d32"), hidden_size=128, num_heads=4, num_kv_heads=2,
                           tokenizer_from=os.environ.get("AGENTRT_TEST_TOKENIZER"))


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 2000, (n,), generator=g).tolist() for n in lengths]


def steps_seen(llm: LLM) -> list[int]:
    """num_steps of every batch the engine schedules from now on."""
    seen: list[int] = []
    llm.core.on_schedule = lambda out: seen.append(out.num_steps)
    return seen


GREEDY_PROMPTS = prompts_of([5, 17, 30, 3])


def greedy_kw(dtype: str) -> dict:
    return dict(num_blocks=96, block_size=4, max_num_batched_tokens=64, max_num_seqs=8, dtype=dtype)


@pytest.fixture(scope="module")
def plain_greedy(model_path):
    """dtype -> the one-step run every multi-step setting is compared with, made once per dtype for the
    module: (stop tokens, params, outputs, steps it took); data only, the engine is not shared."""
    runs = {}

    def run(dtype: str):
        if dtype not in runs:
            plain = LLM(str(model_path), **greedy_kw(dtype))
            prompts = GREEDY_PROMPTS
            first = plain.generate(prompts[:2], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
            stops = [first[0].token_ids[6], first[1].token_ids[11]]  # tokens the greedy outputs reach: cut there
            params = [
                SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stops[0]]),
                SamplingParams(max_tokens=23, temperature=0, stop_token_ids=[stops[1]]),
                SamplingParams(max_tokens=13, temperature=0, ignore_eos=True),
                SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
            ]
            runs[dtype] = stops, params, plain.generate(prompts, params), plain.core.num_steps
        return runs[dtype]

    return run


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [2, 5, 8])
def test_greedy_tokens_identical_with_multi_step(model_path, plain_greedy, dtype, k):
    prompts = GREEDY_PROMPTS
    stops, params, want, plain_steps = plain_greedy(dtype)
    multi = LLM(str(model_path), num_scheduler_steps=k, **greedy_kw(dtype))
    seen = steps_seen(multi)
    got = multi.generate(prompts, params)
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids and g.text == w.text and g.finish_reason == w.finish_reason
    assert got[0].token_ids[-1] == stops[0] and got[0].finish_reason == "stop"
    assert max(seen) == k and multi.core.num_steps < plain_steps - 20  # steps were saved
    assert multi.core.num_rejected_tokens == 0  # a multi-step's tail is not a rejected draft
    assert_all_blocks_free(multi.core)
    # the same requests one at a time: a single row runs whole bursts up to its max_tokens
    for p, sp, w in zip(prompts, params, want, strict=True):
        assert multi.generate([p], sp)[0].token_ids == w.token_ids
    assert_all_blocks_free(multi.core)


def test_multi_step_only_where_the_argmax_is_all_that_is_needed(model_path):
    kw = dict(num_blocks=96, block_size=4, max_num_batched_tokens=64)
    prompts = prompts_of([9, 13], seed=1)
    plain = LLM(str(model_path), **kw)
    multi = LLM(str(model_path), num_scheduler_steps=6, **kw)
    base = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    others = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, top_logprobs=2),
        SamplingParams(max_tokens=12, temperature=0.9, seed=4, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias={500: 5.0}),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, min_tokens=4),
    ]
    for other in others:  # one such request in the batch: every step is a single step
        seen = steps_seen(multi)
        got = multi.generate(prompts, [base, other])
        want = plain.generate(prompts, [base, other])
        assert [g.token_ids for g in got] == [w.token_ids for w in want], other
        assert set(seen) == {1}, other
        if other.logprobs:
            assert got[1].outputs[0].logprobs == pytest.approx(want[1].outputs[0].logprobs, abs=1e-5)
    # a request waiting for a seat: no bursts until it is admitted (it would wait a whole burst)
    one_seat = LLM(str(model_path), num_scheduler_steps=6, max_num_seqs=1, **kw)
    seen = steps_seen(one_seat)
    got = one_seat.generate(prompts, base)
    assert [g.token_ids for g in got] == [w.token_ids for w in plain.generate(prompts, base)]
    assert seen[:12] == [1] * 12 and 6 in seen  # the first request steps alone; the second, last, bursts
    for llm in (multi, one_seat):
        assert_all_blocks_free(llm.core)


def test_multi_step_stops_at_the_context_limit_and_at_eos(model_path):
    kw = dict(num_blocks=64, block_size=4, max_model_len=24)
    prompt = prompts_of([10], seed=2)[0]
    plain = LLM(str(model_path), **kw)
    multi = LLM(str(model_path), num_scheduler_steps=8, **kw)
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want, got = plain.generate([prompt], sp)[0], multi.generate([prompt], sp)[0]
    assert got.token_ids == want.token_ids and len(got.token_ids) == 24 - 10 and got.finish_reason == "length"
    # the model's EOS ends a burst's row as it ends a step (ignore_eos=False): make EOS the 5th greedy token
    eos = want.token_ids[4]
    for llm in (plain, multi):
        llm.core.eos_token_ids = frozenset({eos})
    sp = SamplingParams(max_tokens=40, temperature=0)
    w, g = plain.generate([prompt], sp)[0], multi.generate([prompt], sp)[0]
    assert g.token_ids == w.token_ids == want.token_ids[: want.token_ids.index(eos) + 1]
    assert g.finish_reason == "stop"
    assert_all_blocks_free(multi.core)


def test_python_loop_matches_the_cpp_loop(model_path, tiny_model_path, monkeypatch):
    """Without the C++ path (any device, or rows the C++ kernels do not take) the model loops in Python:
    the same tokens."""
    import agentrt.engine.model as model_mod

    kw = dict(num_blocks=64, block_size=4, num_scheduler_steps=5)
    prompts = prompts_of([7, 12, 4], seed=3)
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    from agentrt import kernels
    ops = kernels.cpu.ops()
    if ops is None:
        pytest.skip("C++ CPU kernels unavailable")
    calls = []
    real = ops.decode_steps
    monkeypatch.setattr(ops, "decode_steps", lambda *a: calls.append(a[18]) or real(*a), raising=False)
    want = LLM(str(model_path), **kw).generate(prompts, params)
    assert calls and max(calls) == 5  # the C++ loop ran
    calls.clear()
    monkeypatch.setattr(model_mod, "BF16_PACKED_MAX_ROWS", 0)  # no decode_forward / decode_steps in C++
    llm = LLM(str(model_path), **kw)
    seen = steps_seen(llm)
    got = llm.generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want] and 5 in seen and not calls
    assert_all_blocks_free(llm.core)
    # head_dim 16: the C++ kernels do not take it, the Python loop runs, the same tokens as single steps
    monkeypatch.undo()
    plain = LLM(str(tiny_model_path), num_blocks=64, block_size=4).generate(prompts, params)
    small = LLM(str(tiny_model_path), **kw)
    seen = steps_seen(small)
    assert [g.token_ids for g in small.generate(prompts, params)] == [p.token_ids for p in plain] and 5 in seen


def test_async_stream_in_bursts(model_path):
    import anyio

    from agentrt.engine import AsyncEngine

    prompt = prompts_of([11], seed=5)[0]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = LLM(str(model_path), num_blocks=64, block_size=4).generate([prompt], params)[0]

    async def main():
        async with AsyncEngine(model=str(model_path), num_blocks=64, block_size=4, num_scheduler_steps=4) as eng:
            stream = eng.add_request(prompt, params)
            streamed, text = [], ""
            async for d in stream:
                streamed.extend(d.new_token_ids)
                text += d.new_text
            out = await stream.result()
            assert streamed == out.token_ids == want.token_ids and text == want.text
            assert eng.core.num_steps <= 1 + 19 // 4 + 1  # the prefill, then bursts of 4
            assert_all_blocks_free(eng.core)

    anyio.run(main)


@pytest.mark.parametrize("which", ["cpp", "python"])
def test_decode_steps_refuses_positions_without_blocks(model_path, tiny_model_path, which):
    llm = LLM(str(model_path if which == "cpp" else tiny_model_path), num_blocks=16, block_size=4)
    model, kv = llm.core.runner.model, llm.core.runner.kv_cache
    ids, pos = torch.tensor([5]), torch.tensor([6])
    stops = torch.full((1, 1), -1, dtype=torch.long)
    tables = torch.tensor([[3, 4, -1]], dtype=torch.int32)  # positions 0-7: 3 steps from 6 need position 8
    with pytest.raises(RuntimeError, match="position 8 maps to block -1|no block table entry"):
        model.decode_steps(ids, pos, kv, tables, stops, 3)
    tokens, counts = model.decode_steps(ids, pos, kv, tables, stops, 2)
    assert tokens.shape == (1, 2) and counts.tolist() == [2]


def test_num_scheduler_steps_is_validated():
    for bad in (0, -3, 1.5, True, "8"):
        with pytest.raises(ValueError, match="num_scheduler_steps"):
            EngineConfig(num_scheduler_steps=bad)


def test_argmax_rows_follows_torch():
    from agentrt import kernels
    ops = kernels.cpu.ops()
    if ops is None:
        pytest.skip("C++ CPU kernels unavailable")
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(v, generator=g) for v in (1, 7, 8, 9, 33, 49152)]
    tie = torch.zeros(20)
    tie[[3, 11, 17]] = 2.0
    nan = torch.randn(40, generator=g)
    nan[[9, 30]] = float("nan")
    rows += [tie, nan, torch.full((13,), float("-inf")), torch.tensor([float("-inf"), float("inf"), float("inf")])]
    for dtype in (torch.float32, torch.bfloat16):
        for r in rows:
            x = r.to(dtype).unsqueeze(0).repeat(2, 1)
            x[1] = x[1].flip(0)
            assert ops.argmax_rows(x).tolist() == x.float().argmax(dim=-1).tolist(), (dtype, r.shape)
