"""N-gram speculative decoding: drafts, verification, and token-for-token equality with plain decoding."""

import pytest
import torch

from agentrt.engine import LLM, SamplingParams
from agentrt.engine.spec_decode import propose_ngram, verify
from tests.conftest import assert_all_blocks_free


def test_propose_finds_latest_longest_match():
    #        0  1  2  3  4  5  6  7  8  9
    toks = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # suffix 3-gram (2, 6, 7) never occurred earlier; 2-gram (6, 7) last occurred at 5..6 -> then 9, 2, 6
    assert propose_ngram(toks, 3, max_n=3, min_n=1) == [9, 2, 6]
    assert propose_ngram(toks, 1, max_n=3, min_n=1) == [9]
    # a longer match wins over a more recent shorter one
    toks = [1, 2, 3, 4, 9, 3, 8, 1, 2, 3]
    assert propose_ngram(toks, 2, max_n=3, min_n=1) == [4, 9]


def test_propose_edge_cases():
    assert propose_ngram([1, 2, 3], 3, 3, 1) == []  # no earlier occurrence
    assert propose_ngram([4, 4], 3, 3, 1) == [4]  # continuation stops at the end of the context
    assert propose_ngram([7], 3, 3, 1) == []
    assert propose_ngram([1, 2, 1, 2], 0, 3, 1) == []
    assert propose_ngram([1, 2, 9, 1, 2], 3, 3, 3) == []  # min_n above what matches
    assert propose_ngram([1, 2, 9, 1, 2], 3, 3, 2) == [9, 1, 2]


def test_verify_accepts_matching_prefix_plus_one():
    assert verify([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]  # all accepted + bonus
    assert verify([1, 2, 3], [1, 5, 3, 4]) == [1, 5]  # second draft rejected: sampled token replaces it
    assert verify([1, 2, 3], [7, 2, 3, 4]) == [7]
    assert verify([], [7]) == [7]


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture
def oracle(monkeypatch):
    """Drafts from a recorded plain run (the tiny random model rarely repeats itself, so prompt lookup
    alone would seldom draft): each draft token is the true next token, or a wrong one with
    probability `wrong`. The engine must give the plain outputs whatever the drafts are."""
    import random

    import agentrt.engine.spec_decode as sd

    def install(runs: dict[tuple[int, ...], list[int]], wrong: float, seed: int = 0):
        rng = random.Random(seed)

        def propose_ngram(tokens, k, max_n, min_n):
            for prompt, out in runs.items():
                if tuple(tokens[: len(prompt)]) == prompt:
                    done = len(tokens) - len(prompt)
                    return [t if rng.random() >= wrong else t + 1 for t in out[done : done + k]]
            raise AssertionError("drafts asked for an unknown request")

        monkeypatch.setattr(sd, "propose_ngram", propose_ngram)

    return install


GREEDY_KW = dict(num_blocks=96, block_size=4, max_num_batched_tokens=32, max_num_seqs=8)
GREEDY_PROMPTS = prompts_of([5, 17, 30, 3])
GREEDY_PARAMS = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (30, 17, 24, 9)]


@pytest.fixture(scope="module")
def plain_greedy(tiny_model_path):
    """The plain run every speculation setting is compared with, made once for the module: its outputs
    and the steps it took (data only: the engine is not shared)."""
    plain = LLM(str(tiny_model_path), **GREEDY_KW)
    return plain.generate(GREEDY_PROMPTS, GREEDY_PARAMS), plain.core.num_steps


@pytest.mark.parametrize(("k", "wrong"), [(1, 0.0), (3, 0.3), (5, 0.5), (4, 1.0)])
def test_greedy_outputs_identical_with_speculation(tiny_model_path, oracle, plain_greedy, k, wrong):
    prompts, params = GREEDY_PROMPTS, GREEDY_PARAMS
    want, plain_steps = plain_greedy
    oracle({tuple(p): w.token_ids for p, w in zip(prompts, want)}, wrong)
    spec = LLM(str(tiny_model_path), num_speculative_tokens=k, **GREEDY_KW)
    got = spec.generate(prompts, params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.text == w.text
        assert g.finish_reason == "length" and g.num_output_tokens == w.num_output_tokens
    core = spec.core
    assert core.num_draft_tokens > 0
    if wrong == 0:
        assert core.num_rejected_tokens == 0  # true drafts are all accepted
    if wrong < 1:
        assert core.num_rejected_tokens < core.num_draft_tokens  # some accepted...
        assert core.num_steps < plain_steps  # ...which saved steps
    else:
        assert core.num_rejected_tokens == core.num_draft_tokens
    assert_all_blocks_free(core)


def test_speculation_with_stops_preemption_and_mixed_sampling(tiny_model_path, oracle):
    kw = dict(num_blocks=14, block_size=4, max_num_batched_tokens=16, max_num_seqs=8)
    plain = LLM(str(tiny_model_path), **kw)
    prompts = prompts_of([9, 13, 11, 10], seed=1)
    greedy = plain.generate(prompts[:1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    stop_id = greedy.token_ids[7]  # a token the greedy output reaches: the stop must cut there
    params = [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop_id]),
        SamplingParams(max_tokens=15, temperature=0.8, seed=3, ignore_eos=True),  # sampled: no drafts
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True),  # logprobs: no drafts
        SamplingParams(max_tokens=22, temperature=0, ignore_eos=True),
    ]
    want = plain.generate(prompts, params)
    full = plain.generate(prompts, SamplingParams(max_tokens=22, temperature=0, ignore_eos=True))
    oracle({tuple(p): f.token_ids for p, f in zip(prompts, full)}, wrong=0.2)
    spec = LLM(str(tiny_model_path), num_speculative_tokens=4, **kw)
    got = spec.generate(prompts, params)
    assert spec.kv_stats().num_preemptions > 0
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
    assert got[0].token_ids[-1] == stop_id and got[0].finish_reason == "stop"
    assert got[2].outputs[0].logprobs is not None and len(got[2].outputs[0].logprobs) == 12
    assert spec.core.num_draft_tokens > spec.core.num_rejected_tokens
    assert_all_blocks_free(spec.core)


def test_propose_on_requests_respects_eligibility_and_limits():
    from agentrt.engine.request import Request
    from agentrt.engine.spec_decode import propose

    def decoding(prompt, out, **sp):
        req = Request("r", list(prompt), SamplingParams(**{"temperature": 0, **sp}))
        for t in out:
            req.append_token(t)
        req.num_computed_tokens = req.num_tokens - 1
        return req

    loop = [1, 2, 3, 4] * 3
    req = decoding(loop, [1], max_tokens=10)
    propose(req, 3, 3, 1)
    assert req.spec_token_ids == [2, 3, 4]
    req = decoding(loop, [1], max_tokens=3)  # 1 produced, 2 to go: one is sampled, so one draft at most
    propose(req, 3, 3, 1)
    assert req.spec_token_ids == [2]
    req = decoding(loop, [1], max_tokens=10)
    req.max_model_len = req.num_tokens + 2  # the context limit also caps drafts
    propose(req, 3, 3, 1)
    assert req.spec_token_ids == [2]
    for kwargs in ({"temperature": 0.7}, {"logprobs": True}, {"n": 2}):
        req = decoding(loop, [1], max_tokens=10, **kwargs)
        propose(req, 3, 3, 1)
        assert req.spec_token_ids == [], kwargs
    req = decoding(loop, [1], max_tokens=10)
    req.num_computed_tokens = 0  # still in prefill: no drafts
    propose(req, 3, 3, 1)
    assert req.spec_token_ids == []


def test_speculation_config_is_validated():
    from agentrt.engine import EngineConfig

    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(prompt_lookup_min=4, prompt_lookup_max=2)


def test_no_drafts_above_the_batch_size_limit(tiny_model_path, oracle):
    prompts = prompts_of([6, 7, 8], seed=4)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    plain = LLM(str(tiny_model_path), num_blocks=64, block_size=4)
    want = plain.generate(prompts, params)
    oracle({tuple(p): w.token_ids for p, w in zip(prompts, want)}, wrong=0.0)
    spec = LLM(str(tiny_model_path), num_blocks=64, block_size=4, num_speculative_tokens=2,
               speculative_disable_by_batch_size=2)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [w.token_ids for w in want]
    assert spec.core.num_draft_tokens == 0  # three requests run together, above the limit of 2
    assert spec.generate(prompts[:2], params)[0].token_ids == want[0].token_ids
    assert spec.core.num_draft_tokens > 0


def test_async_stream_with_speculation(tiny_model_path, oracle):
    import anyio

    from agentrt.engine import AsyncEngine

    prompt = prompts_of([11], seed=5)[0]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = LLM(str(tiny_model_path), num_blocks=64, block_size=4).generate([prompt], params)[0]
    oracle({tuple(prompt): want.token_ids}, wrong=0.25)

    async def main():
        async with AsyncEngine(model=str(tiny_model_path), num_blocks=64, block_size=4,
                               num_speculative_tokens=3) as eng:
            stream = eng.add_request(prompt, params)
            streamed, text = [], ""
            async for d in stream:
                streamed.extend(d.new_token_ids)
                text += d.new_text
            out = await stream.result()
            assert streamed == out.token_ids == want.token_ids and text == want.text
            assert eng.core.num_draft_tokens > eng.core.num_rejected_tokens
            assert eng.core.num_steps < 20  # fewer steps than tokens
            assert_all_blocks_free(eng.core)

    anyio.run(main)
