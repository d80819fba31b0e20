"""Token-for-token parity with HF transformers on the real default model (SmolLM2-135M-Instruct)."""

import pytest
import torch

from agentrt.engine import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free, requires_default_model

pytestmark = [requires_default_model, pytest.mark.slow]

TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring "
    "circuits; later, stored programs let instructions live in memory beside data. Compilers turned "
    "human-readable languages into machine code, and operating systems shared one processor among many "
    "programs by scheduling them in turn. "
)
TARGET_LENGTHS = [5, 23, 64, 131, 250, 377, 480, 600]
MAX_NEW = 16


@pytest.fixture(scope="module")
def prompts(default_model_path):
    from agentrt.engine.loader import load_tokenizer

    tok = load_tokenizer(default_model_path)
    ids = tok(TEXT * 14)["input_ids"]
    return [ids[11 * i : 11 * i + n] for i, n in enumerate(TARGET_LENGTHS)]  # distinct: no shared prefix


@pytest.fixture(scope="module")
def hf_outputs(default_model_path, prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(default_model_path), dtype=torch.float32)
    outs = []
    for p in prompts:  # one at a time: no padding to blur the comparison
        o = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                        max_new_tokens=MAX_NEW, do_sample=False)
        outs.append(o[0, len(p):].tolist())
    return outs


def _check(outs, hf_outputs, eos):
    for o, ref in zip(outs, hf_outputs):
        ref = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert o.token_ids == ref


def test_greedy_matches_hf_all_prompts_together(default_model_path, prompts, hf_outputs):
    llm = LLM(str(default_model_path))
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0))
    assert [o.num_prompt_tokens for o in outs] == TARGET_LENGTHS
    _check(outs, hf_outputs, llm.tokenizer.eos_token_id)
    assert_all_blocks_free(llm.core)


def test_greedy_matches_hf_under_preemption(default_model_path, prompts, hf_outputs):
    # 80 blocks of 16 tokens = 1280 tokens for ~2,150 prompt tokens: preemption is forced
    llm = LLM(str(default_model_path), num_blocks=80, max_num_batched_tokens=512)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0))
    assert llm.kv_stats().num_preemptions > 0
    _check(outs, hf_outputs, llm.tokenizer.eos_token_id)
    assert_all_blocks_free(llm.core)


def test_greedy_matches_hf_with_ngram_speculation(default_model_path, prompts, hf_outputs):
    # the prompts repeat TEXT, so prompt lookup finds real drafts; outputs must not change
    llm = LLM(str(default_model_path), num_speculative_tokens=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0))
    _check(outs, hf_outputs, llm.tokenizer.eos_token_id)
    core = llm.core
    assert core.num_draft_tokens > 0 and core.num_rejected_tokens < core.num_draft_tokens
    assert_all_blocks_free(core)
