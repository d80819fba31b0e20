"""Qwen3.5's hybrid decoder (three Gated DeltaNet layers per gated full-attention layer; `qwen3_5_text`, and
`qwen3_5_moe_text` with 4 experts and a shared expert) against transformers on tiny checkpoints made from its own
config classes (seeded random weights, A_log / dt_bias / conv / norms random too): logits at every prefill and
decode position within NMSE 1e-4 in fp32 (C++ kernels, torch path, Triton attention interpreted), two sequences
in every step (chunked prefill over cached context with shuffled block tables, then batched decode), bf16 within
twice transformers' bf16 error; the recurrent state carried in the engine's state pool. Through the whole engine:
greedy tokens equal to HF's generate with prefix caching on and off, forks, preemption, abort, an agent loop
resuming from state snapshots; every state slot free afterwards."""

import os

import pytest
import torch

from agentrt import kernels
from agentrt.engine.loader import load_model, load_tokenizer, resolve_model
from agentrt.engine.recurrent_state import RecurrentStatePool, RecurrentStep
from agentrt.kernels import cpu as kernels_cpu
from tests.engine.test_moe_models import hf_logits, nmse

VOCAB = 512
BASE = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 5, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4, "tie_word_embeddings": False,
        # layers 0-2 linear, 3 full attention, 4 linear: both kinds, and a linear layer after attention
        "layer_types": ["linear_attention"] * 3 + ["full_attention", "linear_attention"]}
PROMPT_LENS, DECODE_STEPS = (37, 21), 6


def qwen3_5_config():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**BASE, intermediate_size=96)


def qwen3_5_moe_config():
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**BASE, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
                                num_experts_per_tok=2)


CONFIGS = {"qwen3_5_text": qwen3_5_config, "qwen3_5_moe_text": qwen3_5_moe_config}


def make_hf(cfg, seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "A_log" in name:
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 4)))
            elif "dt_bias" in name:
                p.normal_(0, 0.5)
            elif p.dim() >= 2:
                p.normal_(0, 0.1 if "conv1d" not in name else 0.3)
            elif "linear_attn.norm" in name:  # a plain weight (x * w)
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif "norm" in name:  # zero-centred (x * (1 + w))
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.3)
    return hf


def sequences(seed=3, lens=PROMPT_LENS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n + DECODE_STEPS,), generator=g).tolist() for n in lens]


def engine_logits(model, seqs, *, block_size=4, chunk=16):
    """Logits at every position of each sequence, all sequences in every step: prefill in chunks of `chunk`
    tokens, then one token per sequence per step, over a paged cache with shuffled block tables and a state slot
    per sequence."""
    a, w = model.args, model.embed_tokens.weight
    prompts = [len(s) - DECODE_STEPS for s in seqs]
    blocks_per_seq = -(-max(len(s) for s in seqs) // block_size)
    perm = torch.randperm(len(seqs) * blocks_per_seq, generator=torch.Generator().manual_seed(1))
    tables = perm.view(len(seqs), blocks_per_seq).int()
    kv = torch.zeros(a.num_layers, 2, len(seqs) * blocks_per_seq, block_size, a.num_kv_heads, a.head_dim, dtype=w.dtype)
    pool = RecurrentStatePool.for_model(a, 1, 0, block_size, "cpu")
    slots = [pool.new_slot() for _ in seqs]  # the pool grows past its one slot
    done = [0] * len(seqs)
    out = [[] for _ in seqs]
    while any(d < len(s) for d, s in zip(done, seqs)):
        spans = [(d, min(p, d + chunk) if d < p else min(len(s), d + 1)) for d, s, p in zip(done, seqs, prompts)]
        ids = torch.tensor([t for s, (b, e) in zip(seqs, spans) for t in s[b:e]])
        pos = torch.cat([torch.arange(b, e) for b, e in spans])
        seq_of = torch.cat([torch.full((e - b,), i) for i, (b, e) in enumerate(spans)])
        slot_mapping = tables[seq_of, pos // block_size].long() * block_size + pos % block_size
        qsl = torch.tensor([0] + [e - b for b, e in spans]).cumsum(0)
        lens = torch.tensor([e for _, e in spans])
        meta = kernels.build_attention_metadata(query_start_loc=qsl, seq_lens=lens, block_tables=tables,
                                                max_query_len=max(e - b for b, e in spans), max_seq_len=int(lens.max()))
        step = RecurrentStep(pool, slots, [b for b, _ in spans], qsl.tolist(), [[] for _ in seqs])
        with torch.inference_mode(), model.recurrent.use(step):
            logits = model.compute_logits(model(ids, pos, kv, meta, slot_mapping)).float()
        for i, (b, e) in enumerate(spans):
            out[i].append(logits[int(qsl[i]) : int(qsl[i + 1])])
        done = [e for _, e in spans]
    for s in slots:
        pool.release_slot(s)
    pool.check()
    return [torch.cat(o) for o in out]


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf(CONFIGS[request.param]())
    hf.save_pretrained(path)
    load_tokenizer(resolve_model(os.environ.get("AGENTRT_TEST_TOKENIZER"))).save_pretrained(path)
    return request.param, path, hf


@pytest.mark.parametrize("path_name", ["cpp", "torch", "triton"])
def test_fp32_logits_match_hf(checkpoint, path_name):
    name, path, hf = checkpoint
    if path_name == "cpp" and not kernels_cpu.available():
        pytest.skip("C++ CPU kernels cannot be built here")
    seqs = sequences()
    want = hf_logits(hf, seqs)
    with (kernels_cpu.use_cpu_kernels(path_name == "cpp"),
          kernels.use_backend("triton" if path_name == "triton" else "auto")):
        model, _ = load_model(path, torch.float32, "cpu")
        got = engine_logits(model, seqs)
    assert model.args.layer_kinds == ("linear_attention",) * 3 + ("attention", "linear_attention")
    assert [g.shape for g in got] == [w.shape for w in want]
    assert nmse(got, want) < 1e-4


def test_bf16_error_within_twice_hf_bf16(checkpoint):
    """bf16 against fp32: the engine's error no more than twice transformers' own bf16 error (flash-attention's rule;
    on these flat random logits bf16 flips the top token at ~20% of positions on either side, so vLLM's top-5 rule
    does not apply)."""
    name, path, hf = checkpoint
    seqs = sequences(seed=4)
    want = hf_logits(hf, seqs)
    theirs = hf_logits(make_hf(hf.config).to(torch.bfloat16), seqs)
    model, _ = load_model(path, torch.bfloat16, "cpu")
    got = engine_logits(model, seqs)
    assert nmse(got, want) <= 2 * nmse(theirs, want)
    assert nmse(got, want) < 0.1  # bf16 rounding, not a wrong weight (that is ~1)


def assert_all_states_free(core):
    """Every state slot is back in the pool and every snapshot entry is free or cached exactly once."""
    states = core.runner.states
    assert states is core.kv.states
    states.check()
    assert not states.slot_of, f"state slots still held: {states.slot_of}"
    assert states.num_free_slots == states.num_slots


def hf_greedy(hf, prompts, n):
    with torch.no_grad():
        out = []
        for p in prompts:
            ids = torch.tensor([p])
            out.append(hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                   do_sample=False)[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_engine_generates_hf_greedy_tokens(checkpoint, prefix_caching):
    """Through the whole engine (scheduler, chunked prefill of 16-token budgets, batched decode of four sequences,
    prompts sharing a prefix so the second wave resumes from snapshots): HF's greedy tokens, with prefix caching on
    and off; afterwards every KV block and state slot is free."""
    from agentrt.engine import LLM, SamplingParams
    from tests.conftest import assert_all_blocks_free

    name, path, hf = checkpoint
    head = sequences(seed=10, lens=(29,))[0][:29]
    prompts = [s[:n] for s, n in zip(sequences(seed=11) + sequences(seed=12), (5, 23, 40, 12))]
    prompts += [head + p for p in prompts[:2]] + [head + prompts[2][:7]]
    want = hf_greedy(hf, prompts, 8)
    llm = LLM(str(path), dtype="float32", num_blocks=128, block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
              enable_prefix_caching=prefix_caching, recurrent_snapshots=16)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts[:4], params, progress=False)]
    got += [o.token_ids for o in llm.generate(prompts[4:], params, progress=False)]
    assert got == want
    states = llm.core.runner.states
    if prefix_caching:
        assert states.saves > 0 and states.hits > 0  # the second wave resumed from the first's snapshots
    else:
        assert states.saves == 0 and states.hits == 0 and not states.snapshots
    assert_all_blocks_free(llm.core)
    assert_all_states_free(llm.core)


def test_forks_copy_the_state(checkpoint):
    """n = 3 greedy completions fork after the prompt: each child continues from a copy of the parent's state,
    so all three equal HF's greedy tokens; every slot is free afterwards."""
    from agentrt.engine import LLM, SamplingParams

    name, path, hf = checkpoint
    prompt = sequences(seed=13, lens=(19,))[0][:19]
    want = hf_greedy(hf, [prompt], 6)[0]
    llm = LLM(str(path), dtype="float32", num_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=2)
    (out,) = llm.generate([prompt], SamplingParams(n=3, max_tokens=6, temperature=0, ignore_eos=True), progress=False)
    assert [c.token_ids for c in out.outputs] == [want] * 3
    assert_all_states_free(llm.core)


def _tokens(n, seed):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _ttft(o) -> float:
    return o.metrics.first_token_time - o.metrics.arrival_time


def test_react_conversation_resumes_from_snapshots(checkpoint):
    """A 10-call ReAct-style conversation growing past 4k tokens (each call's prompt: the previous prompt, its
    32-token reply, a new 200-token tool result): from call 2 on the call's cached tokens are >= 90% of what it
    shares with the previous call (its prompt and reply), the last call's time to first token is <= 0.2x a cold
    prefill of the same prompt, and its reply equals a cold engine's. Every slot and block is free afterwards, and
    every snapshot entry held once (the LRU of 16 entries evicted along the way)."""
    from agentrt.engine import LLM, SamplingParams
    from tests.conftest import assert_all_blocks_free

    name, path, hf = checkpoint
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", num_blocks=600, block_size=16, max_num_batched_tokens=512,
              recurrent_snapshots=16)
    prompt, calls = _tokens(2200, 11), []
    for k in range(10):
        (o,) = llm.generate([{"prompt_token_ids": prompt}], params, progress=False)
        calls.append((prompt, o.token_ids, o.num_cached_tokens, _ttft(o)))
        prompt = prompt + o.token_ids + _tokens(200, 100 + k)
    for (prev, reply, _, _), (p, _, cached, _) in zip(calls, calls[1:]):
        shared = len(prev) + len(reply)
        assert p[:shared] == prev + reply
        assert cached >= 0.9 * shared, (cached, shared)
    last, reply, _, warm_ttft = calls[-1]
    assert len(last) > 4096
    states = llm.core.runner.states
    assert states.hits >= 9 and states.saves > states.num_snapshots  # the LRU was full and dropped entries
    assert_all_blocks_free(llm.core)
    assert_all_states_free(llm.core)
    assert llm.core.reset_prefix_cache()
    assert not states.snapshots and len(states.free_entries) == states.num_snapshots
    (cold,) = llm.generate([{"prompt_token_ids": last}], params, progress=False)
    assert cold.num_cached_tokens == 0
    assert cold.token_ids == reply
    print(f"ttft warm {warm_ttft:.3f} s, cold {_ttft(cold):.3f} s: {warm_ttft / _ttft(cold):.2f}x")
    assert warm_ttft <= 0.2 * _ttft(cold), (warm_ttft, _ttft(cold))
    other = LLM(str(path), dtype="float32", num_blocks=600, block_size=16, max_num_batched_tokens=512,
                enable_prefix_caching=False)
    (o,) = other.generate([{"prompt_token_ids": last}], params, progress=False)
    assert o.token_ids == reply


def test_preemption_and_abort_give_slots_back(checkpoint):
    """A KV cache too small for four requests at once preempts some (their slots go back; they resume from a
    snapshot or from scratch) and every reply is still HF's greedy one; a request aborted mid-decode gives its slot
    back; in the end every slot and block is free."""
    from agentrt.engine import LLM, SamplingParams
    from tests.conftest import assert_all_blocks_free

    name, path, hf = checkpoint
    prompts = [s[:n] for s, n in zip(sequences(seed=14) + sequences(seed=15), (10, 13, 9, 14))]
    want = hf_greedy(hf, prompts, 12)
    llm = LLM(str(path), dtype="float32", num_blocks=14, block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
              recurrent_snapshots=8)
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                                             progress=False)]
    assert llm.core.scheduler.num_preemptions > 0
    assert got == want
    core = llm.core
    req = core.add_request(prompts[0], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    for _ in range(3):
        core.step()
    assert core.runner.states.slot_of == {req.request_id: 0}
    core.abort(req.request_id)
    assert_all_blocks_free(core)
    assert_all_states_free(core)


@pytest.mark.parametrize("overrides", [{"num_speculative_tokens": 2}, {"num_scheduler_steps": 4}])
def test_drafts_and_multi_step_are_refused_by_name(checkpoint, overrides):
    from agentrt.engine import LLM

    name, path, hf = checkpoint
    with pytest.raises(ValueError, match="recurrent .linear-attention. layers.*num_speculative_tokens=0 and "
                                         "num_scheduler_steps=1"):
        LLM(str(path), dtype="float32", num_blocks=16, **overrides)


def test_recurrent_snapshots_must_be_a_count():
    from agentrt.engine.config import EngineConfig

    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=f"recurrent_snapshots must be an int >= 0, got {bad!r}"):
            EngineConfig(recurrent_snapshots=bad, device="cpu")


def test_a_shared_head_resumes_within_the_snapshot_interval(checkpoint):
    """Two calls sharing a 600-token head (a system prompt) with different tails, each prefilled in one step: the
    first saves the state every 256 tokens, so the second resumes at 512 (not at 0), and its reply is HF's."""
    from agentrt.engine import LLM, SamplingParams

    name, path, hf = checkpoint
    head = _tokens(600, 21)
    prompts = [head + _tokens(90, 22), head + _tokens(70, 23)]
    want = hf_greedy(hf, prompts[1:], 6)
    llm = LLM(str(path), dtype="float32", num_blocks=128, block_size=16, max_num_batched_tokens=1024)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, progress=False)
    (o,) = llm.generate([{"prompt_token_ids": prompts[1]}], params, progress=False)
    assert o.num_cached_tokens == 512
    assert [o.token_ids] == want
    assert_all_states_free(llm.core)


def test_beam_search_resumes_beams_from_snapshots(checkpoint):
    """Beam search runs every live beam as a new request each step: on Qwen3.5 those resume from the state snapshots
    their shared prefixes left (block size 4: beams cross block boundaries), and the beams equal the same search
    over transformers' log-probs."""
    from agentrt.engine import LLM
    from agentrt.engine.beam_search import BeamSearchParams
    from tests.engine.test_beam_search import hf_beam_search

    name, path, hf = checkpoint
    prompt = sequences(seed=16, lens=(10,))[0][:10]
    llm = LLM(str(path), dtype="float32", num_blocks=128, block_size=4)
    (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))
    want = hf_beam_search(hf, prompt, 2, 4, frozenset())
    assert [s.tokens for s in out.sequences] == [t for t, _ in want]
    assert llm.core.runner.states.hits > 0
    assert_all_states_free(llm.core)
