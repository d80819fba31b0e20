"""Sampling parity with vLLM: min_p, presence / frequency / repetition penalties, min_tokens,
logit_bias, prompt logprobs.

Each processor against a plain per-row reference of its vLLM semantics, batched with rows that do
not use it (left bit-for-bit unchanged), against HF transformers' logits processors where HF has
the same one, and in the engine with prefix caching, preemption, forks, speculative decoding and
structured generation.
"""

import math
import re

import pytest
import torch

from agentrt.engine import LLM, SamplingParams
from agentrt.engine.sampling import RowContext, process_logits, sample, topk, warp
from agentrt.engine.sampling_params import InvalidRequestError
from agentrt.engine.structured import Constraint
from tests.conftest import assert_all_blocks_free

V = 300
KW = dict(num_blocks=128, block_size=4, max_num_batched_tokens=64, max_num_seqs=16)
PROMPT = [311, 4090, 77, 1500, 23, 9000, 42, 311, 77]


# ---- plain references: one row, Python loops over its history -----------------------------------
def ref_process(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int], stops: list[int]) -> torch.Tensor:
    row = row.clone()
    if len(output) < p.min_tokens:
        for t in stops:
            row[t] = -math.inf
    for t, b in (p.logit_bias or {}).items():
        row[t] += b
    for t in set(prompt) | set(output):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(output):
        row[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return row


def ref_min_p(row: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = row.softmax(-1)
    return row.masked_fill(probs < min_p * probs.max(), -math.inf)


def history(prompt, output, stops=()):
    return RowContext(torch.tensor(prompt + output), len(prompt), list(stops))


def random_batch(seed: int, rows: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, V, generator=g) * 3
    hists = []
    for _ in range(rows):
        prompt = torch.randint(0, V, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        output = torch.randint(0, 40, (int(torch.randint(0, 25, (1,), generator=g)),), generator=g).tolist()  # repeats
        hists.append((prompt, output))
    return logits, hists


PROCESSORS = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(frequency_penalty=0.9),
    SamplingParams(presence_penalty=-1.2),
    SamplingParams(frequency_penalty=-0.5, presence_penalty=1.5, repetition_penalty=1.3),
    SamplingParams(min_tokens=10, max_tokens=20),
    SamplingParams(logit_bias={3: 5.0, 17: -100.0, 299: 0.5}),
    SamplingParams(min_tokens=3, logit_bias={5: 100}, repetition_penalty=2.0, frequency_penalty=2.0, presence_penalty=2.0),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_processors_match_plain_reference_batched_with_plain_rows(seed):
    plain = SamplingParams()
    params = [x for p in PROCESSORS for x in (p, plain)]  # interleaved with rows that use nothing
    logits, hists = random_batch(seed, len(params))
    stops = [0, 7]
    contexts = [history(pr, out, stops) if p.reads_history else None for p, (pr, out) in zip(params, hists)]
    got = process_logits(logits, params, contexts)
    for i, (p, (prompt, output)) in enumerate(zip(params, hists)):
        if p is plain:
            assert torch.equal(got[i], logits[i])  # untouched, bit for bit
        else:
            torch.testing.assert_close(got[i], ref_process(logits[i], p, prompt, output, stops))
    assert process_logits(logits, [plain] * len(params), None) is logits  # nothing to do: no copy


def test_min_p_matches_reference_and_hf():
    from transformers import MinPLogitsWarper

    logits, _ = random_batch(3, 6)
    params = [SamplingParams(min_p=m, temperature=0.7) for m in (0.0, 0.05, 0.3, 0.9, 1.0, 0.0)]
    got = warp(logits, params)
    for i, p in enumerate(params):
        scaled = logits[i : i + 1] / 0.7
        assert torch.equal(torch.isinf(got[i]), torch.isinf(ref_min_p(scaled[0], p.min_p)))
        if p.min_p > 0:
            hf = MinPLogitsWarper(p.min_p)(None, scaled)[0]
            assert torch.equal(torch.isinf(got[i]), torch.isinf(hf))
        else:
            assert not torch.isinf(got[i]).any()


@pytest.mark.parametrize("kind", ["top_k", "top_p"])
def test_top_k_top_p_match_hf(kind):
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    logits, _ = random_batch(4, 4)
    values = [5, 1, 40, V] if kind == "top_k" else [0.5, 0.9, 0.05, 1.0]
    params = [SamplingParams(temperature=1.0, **{kind: v}) for v in values]
    got = warp(logits, params)
    for i, v in enumerate(values):
        hf = (TopKLogitsWarper(v) if kind == "top_k" else TopPLogitsWarper(v))(None, logits[i : i + 1].clone())[0]
        assert torch.equal(torch.isinf(got[i]), torch.isinf(hf))


def test_repetition_penalty_and_min_tokens_match_hf():
    from transformers import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

    logits, hists = random_batch(5, 4)
    for i, (prompt, output) in enumerate(hists):
        ids = torch.tensor([prompt + output])
        p = SamplingParams(repetition_penalty=1.5)
        got = process_logits(logits[i : i + 1], [p], [history(prompt, output)])[0]
        hf = RepetitionPenaltyLogitsProcessor(1.5)(ids, logits[i : i + 1].clone())[0]
        torch.testing.assert_close(got, hf)
        p = SamplingParams(min_tokens=12, max_tokens=30)
        got = process_logits(logits[i : i + 1], [p], [history(prompt, output, [7])])[0]
        hf = MinNewTokensLengthLogitsProcessor(len(prompt), 12, 7)(ids, logits[i : i + 1].clone())[0]
        assert torch.equal(got, hf)


@pytest.mark.parametrize("kw", [
    dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.02),  # drawn among the top CANDIDATES
    dict(temperature=1.3, top_p=0.6),  # top-p set within the candidates: drawn among them
    dict(temperature=1.0, min_p=0.3),
    dict(temperature=0.9),  # no cut: the whole row
])
def test_draws_follow_the_warped_distribution(kw):
    g = torch.Generator().manual_seed(11)
    row = torch.randn(1, 600, generator=g) * 2
    p = SamplingParams(**kw)
    want = warp(row, [p]).softmax(-1)[0]
    draws = 40000
    tokens = sample(row.expand(draws, -1).contiguous(), [p] * draws, [None] * draws).token_ids
    freq = torch.bincount(tokens, minlength=600).float() / draws
    assert (freq[want == 0] == 0).all()  # nothing outside the kept set
    assert (freq - want).abs().max() < 0.012


def test_a_seeded_row_draws_the_same_whatever_its_batch():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 600, generator=g) * 2
    seeded = SamplingParams(temperature=0.8, top_k=40, seed=3)
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0), SamplingParams(temperature=0.5, top_p=0.3)]
    alone = sample(logits[:1], [seeded], [torch.Generator().manual_seed(3)]).token_ids
    batched = sample(logits, [seeded, *others], [torch.Generator().manual_seed(3), None, None, None]).token_ids
    assert batched[0] == alone[0]
    # a batch whose rows all have a top_k takes only the largest top_k's candidates: 40 alone, 50 here
    # and 256 above; the seeded row's draws are the same each way, step after step
    wider = [SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=0.5, top_k=7)]
    draws = {name: [] for name in ("alone", "top_k 50", "no top_k")}
    gens = {name: torch.Generator().manual_seed(3) for name in draws}
    for _ in range(30):
        draws["alone"].append(sample(logits[:1], [seeded], [gens["alone"]]).token_ids[0].item())
        draws["top_k 50"].append(sample(logits[:3], [seeded, *wider], [gens["top_k 50"], None, None]).token_ids[0].item())
        draws["no top_k"].append(sample(logits, [seeded, *others], [gens["no top_k"], None, None, None]).token_ids[0].item())
    assert draws["alone"] == draws["top_k 50"] == draws["no top_k"]
    assert len(set(draws["alone"])) > 3  # they are draws, not one argmax


def test_sampler_draws_the_same_with_and_without_the_kernels():
    # the sampler's topk / argmax take the C++ kernels on CPU fp32; seeded draws must not change
    from agentrt.kernels import cpu

    if cpu.ops() is None:
        pytest.skip("C++ CPU kernels unavailable")
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 3000, generator=g) * 2
    params = [SamplingParams(temperature=0.8, top_k=40, seed=1), SamplingParams(temperature=1.0, top_p=0.9, seed=2),
              SamplingParams(temperature=0.7, min_p=0.05, seed=3), SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, seed=4, logprobs=True, top_logprobs=5),
              SamplingParams(temperature=0, logprobs=True, top_logprobs=3)]

    def run():
        gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
        return sample(logits, params, gens)

    with_kernels = run()
    with cpu.use_cpu_kernels(False):
        assert topk(logits, 3)[0].equal(logits.topk(3, dim=-1).values)
        without = run()
    assert with_kernels.token_ids.tolist() == without.token_ids.tolist()
    assert with_kernels.top_token_ids.tolist() == without.top_token_ids.tolist()
    assert torch.equal(with_kernels.top_logprobs, without.top_logprobs)


def test_greedy_reads_the_processed_logits_and_logprobs_the_raw_ones():
    logits = torch.tensor([[0.0, 5.0, 1.0, -1.0]])
    p = SamplingParams(temperature=0, logprobs=True, logit_bias={2: 10.0})
    out = sample(logits, [p], [None])
    assert out.token_ids.tolist() == [2]
    assert out.logprobs.item() == pytest.approx(logits.log_softmax(-1)[0, 2].item())


def test_validation_names_the_field_and_value():
    cases = {
        "min_p": 1.5, "presence_penalty": 2.5, "frequency_penalty": -3, "repetition_penalty": 0,
        "prompt_logprobs": 21, "logit_bias": {1: 101},
    }
    for name, value in cases.items():
        with pytest.raises(InvalidRequestError, match=name):
            SamplingParams(**{name: value})
    with pytest.raises(InvalidRequestError, match=r"min_tokens must be an int in \[0, max_tokens=4\], got 5"):
        SamplingParams(min_tokens=5, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="logit_bias keys"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(TypeError, match="logit_bias"):
        SamplingParams(logit_bias=[1, 2])
    assert SamplingParams(logit_bias={"12": 3}).logit_bias == {12: 3.0}  # OpenAI's JSON keys


# ---- in the engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(str(tiny_model_path), **KW)


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)


def ref_greedy(hf, prompt: list[int], p: SamplingParams, eos: list[int]) -> list[int]:
    """Greedy decoding with HF's logits and the plain reference processors, one token at a time."""
    out: list[int] = []
    while len(out) < p.max_tokens:
        with torch.no_grad():
            row = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        tok = int(ref_process(row, p, prompt, out, eos).argmax())
        out.append(tok)
        if tok in eos and len(out) > p.min_tokens:
            break
    return out


PENALIZED = SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.4, frequency_penalty=0.8,
                           presence_penalty=0.5, logit_bias={PROMPT[0]: 8.0})


def test_engine_penalties_match_reference_decoding(llm, hf):
    eos = sorted(llm.core.eos_token_ids)
    want = ref_greedy(hf, PROMPT, PENALIZED, eos)
    plain = SamplingParams(max_tokens=12, temperature=0)
    alone = llm.generate([PROMPT[1:]], plain)[0].token_ids
    outs = llm.generate([PROMPT, PROMPT[1:], PROMPT], [PENALIZED, plain, PENALIZED])
    assert outs[0].token_ids == want and outs[2].token_ids == want  # the second hits the prefix cache
    assert outs[1].token_ids == alone  # a plain request batched with penalized ones is unchanged
    assert want != llm.generate([PROMPT], plain)[0].token_ids  # the penalties did something
    assert_all_blocks_free(llm.core)


def test_hf_generate_repetition_penalty_and_min_new_tokens(llm, hf):
    eos = llm.tokenizer.eos_token_id
    ids = torch.tensor([PROMPT])
    hf_out = hf.generate(ids, max_new_tokens=10, do_sample=False, repetition_penalty=1.3, pad_token_id=eos)
    got = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.3))[0]
    assert got.token_ids == hf_out[0, len(PROMPT):].tolist()


def test_min_tokens_holds_off_eos_stop_ids_and_stop_strings(llm):
    eos = llm.tokenizer.eos_token_id
    forced = {eos: 100.0}
    out = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=20, temperature=0, logit_bias=forced),
                                  SamplingParams(max_tokens=20, temperature=0, logit_bias=forced, min_tokens=5)])
    assert out[0].token_ids == [eos] and out[0].finish_reason == "stop"
    assert len(out[1].token_ids) == 6 and out[1].token_ids[-1] == eos and eos not in out[1].token_ids[:5]
    stop_id = 1000
    out = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0, logit_bias={stop_id: 100.0},
                                                stop_token_ids=[stop_id], min_tokens=3))[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == stop_id
    free = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0]
    first = llm.tokenizer.decode(free.token_ids[:1])
    if first.strip():
        cut = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, stop=[first]))[0]
        held = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, stop=[first], min_tokens=4))[0]
        assert cut.finish_reason == "stop" and len(cut.token_ids) == 1
        assert len(held.token_ids) > 1


def test_penalties_valid_under_preemption(tiny_model_path, llm):
    want = llm.generate([PROMPT], PENALIZED)[0].token_ids
    small = LLM(str(tiny_model_path), num_blocks=14, block_size=4, max_num_batched_tokens=64, max_num_seqs=8,
                enable_prefix_caching=False)
    outs = small.generate([PROMPT] * 4, PENALIZED)
    assert small.core.scheduler.num_preemptions > 0
    assert all(o.token_ids == want for o in outs)
    assert_all_blocks_free(small.core)


def test_forks_each_keep_their_own_history(llm):
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=3, repetition_penalty=1.5, presence_penalty=1.0,
                       min_p=0.05, top_k=50)
    forked = llm.generate([PROMPT], p)[0]
    for i, comp in enumerate(forked.outputs):  # fork i draws with seed + i
        alone = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=1.0, seed=7 + i,
                                                      repetition_penalty=1.5, presence_penalty=1.0, min_p=0.05,
                                                      top_k=50))[0]
        assert comp.token_ids == alone.token_ids


def test_no_drafts_for_penalized_requests_and_drafts_keep_logit_bias(tiny_model_path, llm):
    spec = LLM(str(tiny_model_path), num_speculative_tokens=3, **KW)
    loop = PROMPT * 3
    for p in (PENALIZED, SamplingParams(max_tokens=16, temperature=0, logit_bias={PROMPT[2]: 2.0, PROMPT[3]: -4.0})):
        assert spec.generate([loop], p)[0].token_ids == llm.generate([loop], p)[0].token_ids
    drafted = spec.core.num_draft_tokens
    spec.generate([loop], PENALIZED)
    assert spec.core.num_draft_tokens == drafted  # a penalized request carries no drafts


def test_structured_generation_with_processors(llm):
    c = Constraint("regex", "[0-9]{6}")
    p = SamplingParams(max_tokens=20, temperature=0.8, seed=1, constraint=c, repetition_penalty=2.0,
                       frequency_penalty=2.0, min_p=0.1, logit_bias={llm.tokenizer.encode("7")[0]: 50.0})
    out = llm.generate([PROMPT, PROMPT], [p, SamplingParams(max_tokens=5, temperature=0)])
    assert re.fullmatch("[0-9]{6}", out[0].text), out[0].text


# ---- prompt logprobs ----------------------------------------------------------------------------
def hf_prompt_logprobs(hf, prompt):
    with torch.no_grad():
        logp = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    return [logp[i - 1, t].item() for i, t in enumerate(prompt) if i], logp[:-1]


@pytest.mark.parametrize("chunk", [64, 5])  # whole prompt in one step, or chunked prefill
def test_prompt_logprobs_match_hf(tiny_model_path, hf, chunk):
    llm = LLM(str(tiny_model_path), num_blocks=64, block_size=4, max_num_batched_tokens=chunk, max_num_seqs=4)
    prompt = PROMPT * 2
    want, rows = hf_prompt_logprobs(hf, prompt)
    llm.generate([prompt], SamplingParams(max_tokens=2))  # its blocks are cached now: no hit may be used
    outs = llm.generate([prompt, prompt], [SamplingParams(max_tokens=3, prompt_logprobs=3), SamplingParams(max_tokens=3)])
    out = outs[0]
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
    assert out.prompt_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert len(out.prompt_logprobs) == len(prompt)
    for top, row in zip(out.prompt_top_logprobs[1:], rows):
        assert [t for t, _ in top] == row.topk(3).indices.tolist()
    assert outs[1].prompt_logprobs is None
    zero = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert zero.prompt_logprobs[1:] == pytest.approx(want, abs=1e-4) and zero.prompt_top_logprobs is None


def test_prompt_logprobs_under_preemption(tiny_model_path, hf):
    small = LLM(str(tiny_model_path), num_blocks=14, block_size=4, max_num_batched_tokens=8, max_num_seqs=8,
                enable_prefix_caching=False)
    want, _ = hf_prompt_logprobs(hf, PROMPT)
    outs = small.generate([PROMPT] * 4, SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=0))
    assert small.core.scheduler.num_preemptions > 0
    for o in outs:
        assert o.prompt_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert_all_blocks_free(small.core)


def test_sampler_threads_one_for_small_ops_all_for_vocabulary_passes(monkeypatch):
    """The sampler runs on one intra-op thread, except the passes over the whole vocabulary of
    WIDE_MIN_ROWS rows or more (C++ row kernels), which get every thread back; the count is restored
    after, also when the sampler raises."""
    import agentrt.engine.sampling as sampling

    if sampling._row_ops(torch.zeros(1, 2)) is None:
        pytest.skip("C++ CPU kernels unavailable")
    before = max(2, torch.get_num_threads())
    seen = []

    class Spy:
        def __init__(self, ops):
            self.ops = ops

        def __getattr__(self, name):
            fn = getattr(self.ops, name)

            def call(*args):
                seen.append((name, args[0].shape[0], torch.get_num_threads()))
                return fn(*args)

            return call

    real = sampling._row_ops
    monkeypatch.setattr(sampling, "_row_ops", lambda x: None if (ops := real(x)) is None else Spy(ops))
    torch.set_num_threads(before)
    try:
        for rows in (sampling.WIDE_MIN_ROWS, 2):
            logits, hists = random_batch(rows, rows)
            params = [SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.2, logprobs=True, top_logprobs=3)] * rows
            contexts = [history(pr, out) for pr, out in hists]
            sample(logits, params, [None] * rows, contexts)
            assert torch.get_num_threads() == before
        with pytest.raises(AttributeError):  # a penalized row without its history fails inside the sampler
            sample(torch.zeros(9, V), [SamplingParams(repetition_penalty=1.2)] * 9, [None] * 9, [None] * 9)
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)
    wide = {name: threads for name, rows, threads in seen if rows >= sampling.WIDE_MIN_ROWS}
    narrow = {name: threads for name, rows, threads in seen if rows < sampling.WIDE_MIN_ROWS}
    assert wide["topk_rows"] == wide["logsumexp_rows"] == before and wide["penalize_rows"] == 1
    assert set(narrow.values()) == {1} and {"topk_rows", "logsumexp_rows"} <= narrow.keys()
