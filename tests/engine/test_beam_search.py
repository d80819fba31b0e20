"""Beam search (engine/beam_search.py, `LLM.beam_search`, vLLM's algorithm) against the same search run on
HF transformers' log-probs: the same beams in the same order, cumulative log-probs equal to fp32 rounding;
beam_width 1 is greedy decoding; EOS completes a beam; a long search stays inside the context; every block
is free afterwards and bad parameters are refused naming the field."""

from __future__ import annotations

import pytest
import torch

from agentrt.engine import LLM, BeamSearchParams, SamplingParams
from agentrt.engine.beam_search import BeamSearch, beam_score
from agentrt.engine.sampling_params import InvalidRequestError
from tests.conftest import assert_all_blocks_free

PROMPTS = [[101, 2045, 3306, 712, 88, 17], [4000, 17, 930, 2222, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(str(tiny_model_path), dtype="float32", num_blocks=256, max_num_seqs=32)


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_beam_search(hf, prompt, width, max_tokens, eos, length_penalty=1.0):
    """The same algorithm on HF's log-probs: (tokens, cum_logprob) of the best `width` beams."""
    live, complete = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        grown = []
        for tokens, cum in live:
            logp = hf(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
            vals, ids = logp.topk(2 * width)
            for t, lp in zip(ids.tolist(), vals.tolist()):
                (complete if t in eos else grown).append(([*tokens, t], cum + lp))
        live = sorted(grown, key=lambda b: b[1], reverse=True)[:width]
        if not live:
            break

    def score(b):
        n = len(b[0]) - (1 if b[0][-1] in eos else 0)
        return b[1] / n**length_penalty

    return sorted(complete + live, key=score, reverse=True)[:width]


@pytest.mark.parametrize("width, length_penalty", [(3, 1.0), (2, 0.5)])
def test_beams_match_the_same_search_on_hf(llm, hf, width, length_penalty):
    params = BeamSearchParams(beam_width=width, max_tokens=5, ignore_eos=True, length_penalty=length_penalty)
    outs = llm.beam_search(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        want = hf_beam_search(hf, prompt, width, 5, frozenset(), length_penalty)
        assert [s.tokens for s in out.sequences] == [t for t, _ in want]
        for s, (_, cum) in zip(out.sequences, want, strict=True):
            assert s.cum_logprob == pytest.approx(cum, abs=1e-3)
            assert s.cum_logprob == pytest.approx(sum(s.logprobs), abs=1e-5) and len(s.logprobs) == 5
            assert s.text == llm.tokenizer.decode(s.tokens[len(prompt):], skip_special_tokens=True)
            assert s.finish_reason == "length"
        scores = [beam_score(s, frozenset(), length_penalty) for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
    assert_all_blocks_free(llm.core)


def test_width_one_is_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), progress=False)
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
    for g, b in zip(greedy, beams, strict=True):
        assert b.sequences[0].tokens[len(g.prompt_token_ids):] == g.outputs[0].token_ids


def test_eos_completes_a_beam(llm, hf):
    """EOS completes a beam: it keeps its EOS, leaves the live ones, and its text leaves the EOS out. The tiny
    model rarely ranks its real EOS high, so the search is driven here with the token greedy decoding writes
    second as the EOS: it is among every step's candidates of some beam."""
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), progress=False)
    eos = frozenset(g.outputs[0].token_ids[1] for g in greedy)
    search = BeamSearch(PROMPTS, BeamSearchParams(beam_width=4, max_tokens=6), eos, llm.core.max_model_len)
    while not search.done:
        outs = llm.generate(search.next_prompts(), search.step_params(), progress=False)
        search.advance([o.outputs[0].top_logprobs[0] for o in outs])
    stopped = 0
    for prompt, out in zip(PROMPTS, search.results(llm.tokenizer), strict=True):
        want = hf_beam_search(hf, prompt, 4, 6, eos)
        assert [s.tokens for s in out.sequences] == [t for t, _ in want]
        for s in out.sequences:
            assert s.finish_reason == ("stop" if s.tokens[-1] in eos else "length")
            if s.finish_reason == "stop":
                stopped += 1
                assert s.text == llm.tokenizer.decode(s.tokens[len(prompt):-1], skip_special_tokens=True)
    assert stopped > 0


def test_a_search_stays_inside_the_context(tiny_model_path):
    small = LLM(str(tiny_model_path), dtype="float32", num_blocks=64, max_model_len=24)
    out = small.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=2, max_tokens=50, ignore_eos=True))[0]
    assert all(len(s.tokens) == 24 for s in out.sequences)  # 17 prompt tokens + 7: the context is 24
    assert_all_blocks_free(small.core)


def test_bad_parameters_are_refused(llm):
    with pytest.raises(InvalidRequestError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search(PROMPTS, SamplingParams())
    with pytest.raises(InvalidRequestError, match="prompt"):
        llm.beam_search([[]], BeamSearchParams(beam_width=2, max_tokens=2))
