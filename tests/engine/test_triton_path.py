"""The engine's model on the Triton kernels (interpreted on CPU) gives the reference path's tokens."""

import os

import pytest

from agentrt import kernels
from agentrt.engine import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton path on CPU needs TRITON_INTERPRET=1"
)


def test_triton_and_torch_paths_agree(tiny_model_path):
    llm = LLM(str(tiny_model_path), num_blocks=32, block_size=16, max_num_batched_tokens=32)
    prompts = [[11, 22, 33, 44, 55, 66, 77], list(range(300, 340)), [5, 6, 7]]  # 40 > budget: chunked prefill
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, n=1)
    with kernels.use_backend("torch"):
        ref = llm.generate(prompts, params)
    with kernels.use_backend("triton"):
        tri = llm.generate(prompts, params)
        forked = llm.generate(prompts[0], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, n=2))
    assert [o.token_ids for o in tri] == [o.token_ids for o in ref]
    assert llm.kv_stats().cow_copies > 0  # copy_blocks ran on the Triton path too
    assert [o.token_ids for o in forked[0].outputs] == [ref[0].token_ids[:3]] * 2
    assert_all_blocks_free(llm.core)
