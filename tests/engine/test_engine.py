"""Engine behaviour on a tiny random Llama: HF parity, batching, preemption, sampling, errors."""

import os

import anyio
import pytest
import torch

from agentrt.engine import LLM, AsyncEngine, EngineCore, RequestStatus, SamplingParams
from agentrt.engine.errors import InvalidRequestError
from tests.conftest import assert_all_blocks_free

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def hf_greedy(path, prompt_ids, max_new):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(str(tiny_model_path), num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)


def test_greedy_matches_hf_batched_with_chunked_prefill(llm, tiny_model_path):
    prompts = prompts_of([5, 17, 64, 3, 90])  # 90 > token budget: chunked prefill
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(tiny_model_path, p, 12)
        assert o.finish_reason == "length" and o.num_output_tokens == 12
    assert_all_blocks_free(llm.core)


def test_preemption_keeps_greedy_outputs(tiny_model_path):
    small = LLM(str(tiny_model_path), num_blocks=14, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    prompts = prompts_of([9, 13, 11, 10], seed=1)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = small.generate(prompts, params)
    assert small.kv_stats().num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(tiny_model_path, p, 10)
    assert_all_blocks_free(small.core)


def test_request_that_never_fits_is_refused_before_the_engine(tiny_model_path):
    small = LLM(str(tiny_model_path), num_blocks=4, block_size=4)
    ok, too_big = prompts_of([5, 40], seed=2)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match=r"needs 11 KV blocks for 40 prompt \+ 3 output tokens") as e:
        small.generate([ok, too_big], params)
    assert e.value.parameter == "max_tokens" and e.value.value == 3
    with pytest.raises(InvalidRequestError, match=r"needs 5 KV blocks for 5 prompt \+ 15 output"):
        small.generate([ok], SamplingParams(max_tokens=15))  # the output counts too
    assert not small.core.has_work()
    outs = small.generate([ok], params)  # nothing of the refused ones reached the engine
    assert outs[0].finish_reason == "length" and outs[0].num_output_tokens == 3
    assert_all_blocks_free(small.core)


def test_scheduler_still_fails_a_request_that_never_fits_alone(tiny_model_path):
    """The scheduler's own check stays (a request added without the engine's checks): it fails alone."""
    from agentrt.engine.admission import CheckedRequest, RequestOwner

    core = EngineCore(model=str(tiny_model_path), num_blocks=4, block_size=4)
    ok, too_big = prompts_of([5, 40], seed=2)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    core.add_checked(core.admit(ok, params, request_id="ok"))
    core.add_checked(CheckedRequest("big", core.validate_prompt(too_big, None), core.validate_params(params),
                                    RequestOwner(), None))  # past the engine's checks
    done = {}
    while core.has_work():
        for d in core.step():
            if d.finished:
                done[d.request_id] = d
    assert done["ok"].finish_reason == "length"
    assert done["big"].finish_reason == "error" and "needs 11 KV blocks" in done["big"].error
    assert_all_blocks_free(core)


def test_params_per_prompt_and_seeded_sampling_is_reproducible(llm):
    prompts = prompts_of([6, 8], seed=3)
    a = llm.generate(prompts, [SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True), GREEDY])
    b = llm.generate(prompts, [SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True), GREEDY])
    assert a[0].token_ids == b[0].token_ids and a[1].token_ids == b[1].token_ids
    assert len(a[1].token_ids) == 12
    c = llm.generate(prompts[0], SamplingParams(max_tokens=8, temperature=1.0, seed=8, ignore_eos=True))
    assert c[0].token_ids != a[0].token_ids


def test_top_k_1_is_greedy_and_logprobs(llm):
    p = prompts_of([7], seed=4)[0]
    g = llm.generate(p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True))[0]
    k1 = llm.generate(p, SamplingParams(max_tokens=6, temperature=2.0, top_k=1, ignore_eos=True, seed=1))[0]
    tp = llm.generate(p, SamplingParams(max_tokens=6, temperature=1.0, top_p=1e-6, ignore_eos=True, seed=1))[0]
    assert g.token_ids == k1.token_ids == tp.token_ids
    lps = g.outputs[0].logprobs
    assert len(lps) == 6 and all(lp <= 0 for lp in lps)


def test_stop_token_ids_and_stop_strings(llm):
    p = prompts_of([7], seed=5)[0]
    full = llm.generate(p, GREEDY)[0]
    stop_tok = full.token_ids[4]
    cut = llm.generate(p, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_tok], ignore_eos=True))[0]
    assert cut.finish_reason == "stop"
    assert cut.token_ids == full.token_ids[: full.token_ids.index(stop_tok) + 1]
    needle = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    if needle.strip():
        s = llm.generate(p, SamplingParams(max_tokens=12, temperature=0, stop=[needle], ignore_eos=True))[0]
        assert s.finish_reason == "stop" and needle not in s.text and full.text.startswith(s.text)


def test_n_greater_than_one_forks(llm):
    p = prompts_of([10], seed=6)[0]
    out = llm.generate(p, SamplingParams(n=3, max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs) == 3 and len({tuple(o.token_ids) for o in out.outputs}) == 1
    seeded = llm.generate(p, SamplingParams(n=3, max_tokens=5, temperature=1.5, seed=3, ignore_eos=True))[0]
    assert [o.index for o in seeded.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in seeded.outputs}) > 1
    assert llm.kv_stats().cow_copies > 0
    assert_all_blocks_free(llm.core)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="does not fit the model's context of 2048"):
        llm.generate([[5] * 3000], GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[5, -1]], GREEDY)
    assert llm.generate("hello there", GREEDY)[0].num_output_tokens == 12
    assert_all_blocks_free(llm.core)


def test_unknown_model_path():
    with pytest.raises(ValueError, match="unknown model path '/nonexistent/model'"):
        LLM("/nonexistent/model")


def test_async_engine_streams_and_aborts(tiny_model_path):
    async def main():
        async with AsyncEngine(model=str(tiny_model_path), num_blocks=64, block_size=4) as eng:
            s1 = eng.add_request("hello world", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
            s2 = eng.add_request("another prompt", SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
            with pytest.raises(ValueError, match="max_tokens"):
                eng.add_request("x", SamplingParams(max_tokens=0))
            got = []
            async for d in s1:
                got.extend(d.new_token_ids)
            out1 = await s1.result()
            assert out1.token_ids == got and len(got) == 8 and out1.finish_reason == "length"
            eng.abort(s2.request_id)
            out2 = await s2.result()
            assert out2.finish_reason == "abort" and out2.num_output_tokens < 200
            s3 = eng.add_request("after abort", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
            assert (await s3.result()).num_output_tokens == 3
            assert_all_blocks_free(eng.core)

    anyio.run(main)


def test_abort_reaches_every_fork(tiny_model_path):
    core = EngineCore(model=str(tiny_model_path), num_blocks=64, block_size=4)
    req = core.add_request([5, 6, 7, 8, 9], SamplingParams(n=3, max_tokens=50, temperature=1.0, seed=0, ignore_eos=True))
    core.step()  # prefill and first sample: the forks join the batch
    assert all(c.request_id in core.requests for c in req.children)
    core.scheduler.finish(req, RequestStatus.FINISHED_LENGTH, "length")  # the parent ends first ...
    deltas = core.abort(req.request_id)  # ... and aborting it by id still ends its forks
    assert sorted(d.request_id for d in deltas) == [c.request_id for c in req.children]
    assert all(d.finished and d.finish_reason == "abort" for d in deltas)
    assert core.finished_output(req).outputs[1].finish_reason == "abort"
    assert_all_blocks_free(core)



def test_rope_pair_layout_preserves_attention_scores():
    """The model keeps q and k in an adjacent-pair layout; q.k after RoPE must equal HF's layout."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from agentrt.engine.model import apply_rope, interleave_rope_rows

    torch.manual_seed(0)
    T, H, D = 7, 3, 16
    q, k = torch.randn(T, H, D), torch.randn(T, H, D)
    pos = torch.arange(T, dtype=torch.float32) * 5
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.outer(pos, inv)
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    scores_hf = q_hf[0] @ k_hf[0].transpose(-1, -2)  # [H, T, T]
    cis = torch.complex(freqs.cos(), freqs.sin())[:, None]
    # the same rows permuted as load_hf_state_dict permutes q/k projection rows
    qp = interleave_rope_rows(q.reshape(T, H * D).t(), H, D).t().reshape(T, H, D)
    kp = interleave_rope_rows(k.reshape(T, H * D).t(), H, D).t().reshape(T, H, D)
    qr, kr = apply_rope(qp, cis), apply_rope(kp, cis)
    scores = qr.transpose(0, 1) @ kr.transpose(0, 1).transpose(-1, -2)
    torch.testing.assert_close(scores, scores_hf, rtol=1e-5, atol=1e-5)
    # and the pair layout is a real permutation: position 1 holds HF's dim D/2
    assert torch.equal(qp[:, :, 1], q[:, :, D // 2])


def test_llama31_layout_matches_hf(tmp_path):
    """Llama-3.1-8B's layout, scaled down: head_dim 128, GQA 4, llama3 rope scaling, untied lm_head."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from agentrt.engine.loader import load_tokenizer, resolve_model
    from agentrt.engine.testing import PRESETS

    cfg = {**PRESETS["llama-3.1-8b"], "num_hidden_layers": 2, "hidden_size": 512, "intermediate_size": 1024,
           "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 49152}
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
    hf.save_pretrained(tmp_path)
    load_tokenizer(resolve_model(os.environ.get("AGENTRT_TEST_TOKENIZER"))).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), num_blocks=64, block_size=16, max_num_batched_tokens=128)
    prompts = prompts_of([20, 300], seed=7)
    for p, o in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
        ids = torch.tensor([p])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                           do_sample=False)[0, len(p):].tolist()
        assert o.token_ids == want
    assert_all_blocks_free(llm.core)
