"""Log-probs of the sampled tokens and the top-N alternatives: against HF's log_softmax, with
n > 1 forks, with speculative decoding, and per streamed delta."""

import random

import anyio
import pytest
import torch

import agentrt.engine.spec_decode as sd
from agentrt.engine import LLM, AsyncEngine, SamplingParams
from agentrt.engine.runner import _top_lists
from agentrt.engine.sampling import sample
from tests.conftest import assert_all_blocks_free

KW = dict(num_blocks=96, block_size=4, max_num_batched_tokens=32, max_num_seqs=8)
PROMPT = [311, 4090, 77, 1500, 23, 9000, 42]


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(str(tiny_model_path), **KW)


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)


def hf_logprobs(hf, prompt, output):
    """[len(output), V]: HF's log_softmax at each position that produced an output token."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0].float()
    return logits.log_softmax(-1)[len(prompt) - 1 : len(prompt) - 1 + len(output)]


def check_against_hf(hf, prompt, comp, num_top):
    ref = hf_logprobs(hf, prompt, comp.token_ids)
    assert len(comp.logprobs) == len(comp.top_logprobs) == len(comp.token_ids)
    for row, tok, lp, top in zip(ref, comp.token_ids, comp.logprobs, comp.top_logprobs):
        assert lp == pytest.approx(row[tok].item(), abs=1e-4)
        want = row.topk(num_top)
        assert [t for t, _ in top] == want.indices.tolist()
        assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-4)
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))  # best first
        if tok in dict(top):
            assert dict(top)[tok] == pytest.approx(lp, abs=1e-6)


def test_sampler_top_n_is_one_batched_op():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    params = [SamplingParams(temperature=0, top_logprobs=n) for n in (0, 3, 5, 1)]
    out = sample(logits, params, [None] * 4)
    ref = logits.log_softmax(-1)
    assert out.top_token_ids.shape == (4, 5)  # N = the batch's largest
    assert torch.equal(out.top_token_ids, ref.topk(5).indices)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None])[:, 0])
    tops = _top_lists(out, params)
    assert tops[0] is None and [len(t) for t in tops[1:]] == [3, 5, 1]
    assert tops[1] == [(i, v) for i, v in zip(ref[1].topk(3).indices.tolist(), ref[1].topk(3).values.tolist())]
    assert sample(logits, [SamplingParams(temperature=0)] * 4, [None] * 4).logprobs is None


def test_greedy_top_logprobs_match_hf(llm, hf):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, top_logprobs=5))[0]
    comp = out.outputs[0]
    check_against_hf(hf, PROMPT, comp, 5)
    assert all(top[0] == (tok, lp) for tok, lp, top in zip(comp.token_ids, comp.logprobs, comp.top_logprobs))
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].outputs[0]
    assert plain.logprobs is None and plain.top_logprobs is None and plain.token_ids == comp.token_ids
    assert_all_blocks_free(llm.core)


def test_sampled_tokens_logprobs_match_hf(llm, hf):
    params = SamplingParams(max_tokens=8, temperature=1.3, top_k=50, seed=5, ignore_eos=True, logprobs=True, top_logprobs=3)
    comp = llm.generate(PROMPT, params)[0].outputs[0]
    check_against_hf(hf, PROMPT, comp, 3)  # raw log_softmax, whatever temperature and top-k did


def test_top_logprobs_with_forks(llm, hf):
    params = SamplingParams(n=3, max_tokens=5, temperature=1.5, seed=2, ignore_eos=True, top_logprobs=2)
    out = llm.generate(PROMPT, params)[0]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    for comp in out.outputs:
        check_against_hf(hf, PROMPT, comp, 2)
    assert len({tuple(o.top_logprobs[0]) for o in out.outputs}) == 1  # first token: one logits row for all forks
    assert_all_blocks_free(llm.core)


def test_top_logprobs_with_speculative_decoding(tiny_model_path, llm, monkeypatch):
    prompts = [PROMPT, [5, 6, 7, 8, 9, 10]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, top_logprobs=4)
    want = llm.generate(prompts, params)
    runs = {tuple(p): w.token_ids for p, w in zip(prompts, want)}
    rng = random.Random(0)

    def oracle(tokens, k, max_n, min_n):  # the true next tokens, a third of them wrong
        for prompt, out in runs.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                return [t if rng.random() > 0.3 else t + 1 for t in out[done : done + k]]
        raise AssertionError("drafts asked for an unknown request")

    monkeypatch.setattr(sd, "propose_ngram", oracle)
    spec = LLM(str(tiny_model_path), num_speculative_tokens=3, **KW)
    got = spec.generate(prompts, params)
    core = spec.core
    assert core.num_draft_tokens > core.num_rejected_tokens > 0  # some drafts accepted, some not
    for w, g in zip(want, got):
        w, g = w.outputs[0], g.outputs[0]
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        assert [[t for t, _ in top] for top in g.top_logprobs] == [[t for t, _ in top] for top in w.top_logprobs]
        for a, b in zip(g.top_logprobs, w.top_logprobs):
            assert [v for _, v in a] == pytest.approx([v for _, v in b], abs=1e-4)
    assert_all_blocks_free(core)


def test_stream_deltas_carry_their_logprobs(tiny_model_path):
    async def main():
        async with AsyncEngine(model=str(tiny_model_path), **KW) as eng:
            with_top = eng.add_request(PROMPT, SamplingParams(max_tokens=7, n=2, temperature=1.0, seed=1,
                                                              ignore_eos=True, top_logprobs=2))
            only_lp = eng.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=True))
            plain = eng.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            for stream, has_lp, has_top in ((with_top, True, True), (only_lp, True, False), (plain, False, False)):
                got: dict[int, tuple[list, list]] = {}
                async for d in stream:
                    lps, tops = got.setdefault(d.index, ([], []))
                    assert (d.new_logprobs is not None) == (has_lp and bool(d.new_token_ids))
                    assert (d.new_top_logprobs is not None) == (has_top and bool(d.new_token_ids))
                    lps.extend(d.new_logprobs or [])
                    tops.extend(d.new_top_logprobs or [])
                out = await stream.result()
                for comp in out.outputs:
                    lps, tops = got[comp.index]
                    assert lps == (comp.logprobs or []) and tops == (comp.top_logprobs or [])
                    assert len(lps) == (len(comp.token_ids) if has_lp else 0)
            assert_all_blocks_free(eng.core)

    anyio.run(main)
