"""Deterministic mode on the real model (SmolLM2-135M), bf16 and fp32: a greedy request's tokens, and the
log-probabilities they came with, bit for bit, do not depend on what else the engine runs (a batch of 32
mixed requests), on prefix-cache hits, on how its prompt is chunked, or on preemption and recompute; seeded
sampling repeats. Streamed vs non-streamed through the server: tests/server/test_deterministic_server.py."""

import random

import pytest

from agentrt.engine import LLM, EngineConfig, SamplingParams
from agentrt.kernels import cpu
from tests.conftest import assert_all_blocks_free, requires_default_model

pytestmark = [requires_default_model,
              pytest.mark.skipif(not cpu.available(), reason="deterministic mode needs the C++ CPU kernels")]

TOKENS = 32
WORDS = ["the", "agent", "calls", "a", "tool", "and", "reads", "its", "result", "then", "plans", "the", "next", "step", "of", "the", "program", "while", "the", "engine", "batches", "every", "request", "it", "holds", "and", "caches", "blocks", "of", "tokens", "by", "their", "content"]


def prompt(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=True, **kw)


def result(out) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    return list(c.token_ids), [lp for lp in c.logprobs]


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def llm(request, default_model_path):
    engine = LLM(str(default_model_path), dtype=request.param, deterministic=True, seed=0)
    engine.greedy_alone = {}  # text -> its greedy result alone (see `reference`)
    yield engine
    assert_all_blocks_free(engine.core)


TARGET = prompt(random.Random(7), 120)


def alone(llm, text=TARGET, params=None):
    llm.core.reset_prefix_cache()
    return result(llm.generate([text], params or greedy())[0])


def reference(llm, text=TARGET):
    """`alone(llm, text)` with greedy params, computed once per engine: the tests compare against it (the same
    engine and prompt gave the same bits each time they recomputed it; that a request alone repeats is itself
    checked by test_prefix_cache_hit_equals_miss, whose first `alone` is a miss like this one)."""
    if text not in llm.greedy_alone:
        llm.greedy_alone[text] = alone(llm, text)
    return llm.greedy_alone[text]


def test_alone_equals_in_a_batch_of_32_mixed_requests(llm):
    want = reference(llm)
    rng = random.Random(1)
    mixed = [prompt(rng, rng.randint(3, 150)) for _ in range(31)]  # (300 words and 60 tokens took 100 s in float32)
    params = [SamplingParams(temperature=rng.choice([0, 0.7, 1.0]), max_tokens=rng.randint(1, TOKENS + 6), seed=i)
              for i in range(31)]
    for position in (0, 17, 31):
        llm.core.reset_prefix_cache()
        texts = mixed[:position] + [TARGET] + mixed[position:]
        outs = llm.generate(texts, params[:position] + [greedy()] + params[position:])
        assert result(outs[position]) == want, f"the target at position {position} of the batch"
    assert llm.kv_stats().num_preemptions == 0


def test_prefix_cache_hit_equals_miss(llm):
    want = alone(llm)
    assert want == reference(llm)  # alone, again: the same bits
    assert result(llm.generate([TARGET], greedy())[0]) == want  # the whole prompt but its last token cached
    assert llm.kv_stats().prefix_hit_tokens > 0
    # a longer prompt whose head another request cached: the head's blocks hit, its tail is computed
    longer = TARGET + " " + prompt(random.Random(8), 40)
    cold = alone(llm, longer)
    llm.core.reset_prefix_cache()
    llm.generate([TARGET], SamplingParams(max_tokens=1))
    assert result(llm.generate([longer], greedy())[0]) == cold


@pytest.mark.parametrize("chunk", [16, 37, 64, 129])
def test_chunked_prefill_equals_unchunked(llm, chunk):
    text = TARGET + " " + prompt(random.Random(9), 150)  # ~330 tokens
    config = llm.core.config
    want = reference(llm, text)  # max_num_batched_tokens 1024: one chunk (computed for the first chunk size only)
    saved = config.max_num_batched_tokens
    config.max_num_batched_tokens = chunk
    try:
        assert alone(llm, text) == want
    finally:
        config.max_num_batched_tokens = saved


def test_seeded_sampling_repeats_alone_and_in_a_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=TOKENS, seed=1234, ignore_eos=True, logprobs=True)
    first = alone(llm, params=params)
    assert alone(llm, params=params) == first
    rng = random.Random(2)
    others = [prompt(rng, rng.randint(5, 200)) for _ in range(7)]
    outs = llm.generate([*others, TARGET], [greedy()] * 7 + [params])
    assert result(outs[-1]) == first


def test_preempted_and_recomputed_equals_uninterrupted(llm, default_model_path):
    """The 6 requests uninterrupted (in one batch of the module's roomy engine: no preemption; that a batch gives
    each request its bits alone is test_alone_equals_in_a_batch_of_32_mixed_requests') against the same 6 in an
    engine too small to hold them, which preempts and recomputes."""
    dtype = llm.core.config.dtype
    rng = random.Random(3)
    texts = [prompt(rng, rng.randint(60, 120)) for _ in range(6)]
    llm.core.reset_prefix_cache()
    preemptions = llm.kv_stats().num_preemptions
    want = [result(o) for o in llm.generate(texts, greedy())]
    assert llm.kv_stats().num_preemptions == preemptions  # uninterrupted
    # 6 requests of ~100-160 tokens need ~60 blocks of 16 at the end; 36 make some wait and be preempted
    tight = LLM(str(default_model_path), dtype=dtype, deterministic=True, num_blocks=36, enable_prefix_caching=False)
    got = [result(o) for o in tight.generate(texts, greedy())]
    assert tight.kv_stats().num_preemptions > 0
    assert got == want
    assert_all_blocks_free(tight.core)


def test_deterministic_is_refused_where_it_cannot_hold():
    with pytest.raises(ValueError, match="deterministic must be true, false or None .where it holds., got 'yes'"):
        EngineConfig(device="cpu", deterministic="yes")
    with pytest.raises(ValueError, match="deterministic needs dtype float32 or bfloat16.*'float16'"):
        EngineConfig(device="cpu", dtype="float16", deterministic=True)
    with cpu.use_cpu_kernels(False), pytest.raises(ValueError, match="deterministic needs the C.. CPU kernels"):
        LLM(deterministic=True, dtype="float32")
