"""Embeddings (engine.pooling, `LLM.embed`): a prompt's final hidden states pooled, against HF's base
model (`last_hidden_state`, after the final norm) on the tiny random Llama."""

import anyio
import pytest
import torch

from agentrt.engine import LLM, AsyncEngine, EngineCore, PoolingParams, SamplingParams
from agentrt.engine.sampling_params import InvalidRequestError, InvalidRequestTypeError
from tests.conftest import assert_all_blocks_free

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(100, 140)), [42]]


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    # 16-token steps: the 40-token prompt is pooled over three chunks
    return LLM(str(tiny_model_path), num_blocks=64, block_size=4, max_num_batched_tokens=16)


@torch.no_grad()
def reference(hf, prompt, method):
    h = hf(torch.tensor([prompt])).last_hidden_state[0].double()
    return {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[method]


@pytest.mark.parametrize("method", ["last", "mean", "cls"])
def test_pooling_matches_hf(llm, hf, method):
    outs = llm.embed(PROMPTS, PoolingParams(method, normalize=False))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "stop"
        torch.testing.assert_close(torch.tensor(out.embedding, dtype=torch.float64), reference(hf, prompt, method),
                                   rtol=1e-4, atol=1e-4)
    assert_all_blocks_free(llm.core)
    assert set(llm.core.num_tracked().values()) == {0}


def test_normalize_and_dimensions(llm, hf):
    """The default: the last token's row at unit length; `dimensions` keeps the first D, then normalizes."""
    full, cut = llm.embed([PROMPTS[1]])[0].embedding, llm.embed(PROMPTS[1], PoolingParams(dimensions=10))[0].embedding
    ref = reference(hf, PROMPTS[1], "last")
    torch.testing.assert_close(torch.tensor(full, dtype=torch.float64), ref / ref.norm(), rtol=1e-4, atol=1e-5)
    assert len(cut) == 10
    torch.testing.assert_close(torch.tensor(cut, dtype=torch.float64), ref[:10] / ref[:10].norm(), rtol=1e-4,
                               atol=1e-5)


def test_last_reads_the_prefix_cache_and_mean_does_not(llm, hf):
    """A prompt whose blocks are cached: last-token pooling computes only what the cache lacks (the same
    vector), mean pooling computes every row (no hits) and is still right."""
    prompt = list(range(300, 333))
    llm.generate([prompt], SamplingParams(max_tokens=1))  # caches its full blocks
    last = llm.embed(prompt, PoolingParams("last", normalize=False))[0]
    mean = llm.embed(prompt, PoolingParams("mean", normalize=False))[0]
    assert last.metrics.num_prefix_hit_tokens == 32
    assert mean.metrics.num_prefix_hit_tokens == 0
    for out, method in ((last, "last"), (mean, "mean")):
        torch.testing.assert_close(torch.tensor(out.embedding, dtype=torch.float64), reference(hf, prompt, method),
                                   rtol=1e-4, atol=1e-4)
    assert_all_blocks_free(llm.core)


def test_embeddings_batch_with_generation_and_survive_preemption(tiny_model_path, hf):
    """Pooling requests share steps with generating ones, whose greedy tokens do not change; in a cache
    too small for all of them the pooling request (the latest arrival) is preempted mid-prompt, and its
    mean pooled over the recomputed prompt is still the prompt's mean (the sum restarts with it)."""
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    gen_prompts = [list(range(1000 + 50 * i, 1016 + 50 * i)) for i in range(3)]
    alone = [o.token_ids for o in LLM(str(tiny_model_path), num_blocks=64, block_size=4).generate(gen_prompts, greedy)]
    core = EngineCore(model=str(tiny_model_path), num_blocks=20, block_size=4, max_num_batched_tokens=12,
                      enable_prefix_caching=False)
    gens = [core.add_request(p, greedy) for p in gen_prompts]
    pool = core.add_request(PROMPTS[1], SamplingParams(max_tokens=1, pooling=PoolingParams("mean", normalize=False)))
    while core.has_work():
        core.step()
    assert pool.num_preemptions > 0
    assert [core.finished_output(r).token_ids for r in gens] == alone
    out = core.finished_output(pool)
    torch.testing.assert_close(torch.tensor(out.embedding, dtype=torch.float64), reference(hf, PROMPTS[1], "mean"),
                               rtol=1e-4, atol=1e-4)
    assert_all_blocks_free(core)
    assert set(core.num_tracked().values()) == {0}


def test_async_engine_streams_the_embedding(tiny_model_path):
    async def main():
        async with AsyncEngine(model=str(tiny_model_path), num_blocks=32, block_size=4) as eng:
            stream = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=1, pooling=PoolingParams()))
            deltas = [d async for d in stream]
            out = await stream.result()
            assert len(deltas) == 1 and deltas[0].finished and deltas[0].embedding == out.embedding
            assert len(out.embedding) == 64 and abs(sum(x * x for x in out.embedding) - 1) < 1e-5
    anyio.run(main)


@pytest.mark.parametrize("make, error, match", [
    (lambda: PoolingParams("max"), InvalidRequestError, "method must be one of last, mean, cls, got 'max'"),
    (lambda: PoolingParams(dimensions=0), InvalidRequestError, "dimensions must be None or an int >= 1, got 0"),
    (lambda: PoolingParams(normalize="yes"), InvalidRequestTypeError, "normalize must be a bool"),
    (lambda: SamplingParams(pooling="last"), InvalidRequestTypeError, "pooling must be an engine.pooling"),
    (lambda: SamplingParams(n=2, pooling=PoolingParams()), InvalidRequestError, "n must be 1 for a pooling"),
    (lambda: SamplingParams(logprobs=True, pooling=PoolingParams()), InvalidRequestError, "logprobs must be False"),
])
def test_bad_pooling_params(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_dimensions_past_the_hidden_size_refused_before_anything_runs(llm):
    with pytest.raises(InvalidRequestError, match="dimensions must be <= the model's hidden size 64, got 65"):
        llm.embed(PROMPTS, PoolingParams(dimensions=65))
    assert set(llm.core.num_tracked().values()) == {0}


def test_base_model_checkpoint_and_declared_pooling(tmp_path, tiny_model_path, hf):
    """An embedding model's checkpoint as HF's AutoModel saves it (no "model." prefix, no LM head) loads,
    and the pooling its sentence-transformers files declare is found (else "last")."""
    import json

    from agentrt.engine.loader import load_tokenizer
    from agentrt.engine.pooling import default_method

    hf.save_pretrained(tmp_path)
    load_tokenizer(tiny_model_path).save_pretrained(tmp_path)
    assert default_method(tmp_path) == "last"
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}))
    assert default_method(tmp_path) == "mean"
    out = LLM(str(tmp_path), num_blocks=32, block_size=4).embed(PROMPTS[1], PoolingParams("mean", normalize=False))[0]
    torch.testing.assert_close(torch.tensor(out.embedding, dtype=torch.float64), reference(hf, PROMPTS[1], "mean"),
                               rtol=1e-4, atol=1e-4)
