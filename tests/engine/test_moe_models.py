"""Mixture-of-experts architectures (Mixtral, Qwen3-MoE, Qwen2-MoE's shared expert, gpt-oss) against HF
transformers on tiny seeded checkpoints made from transformers' own config classes (2 layers, 4 experts,
top 2): logits at every prefill and decode position of two sequences run together (chunked prefill,
then one-token decode steps), in fp32 within NMSE 1e-4 on the C++ kernels, on the torch path and with
the Triton attention (interpreted); in bf16 by vLLM's top-5 rule. Every weight is random, router and
expert biases included, so a weight loaded into the wrong expert, or gate and up swapped, shows."""

import pytest
import torch

from agentrt import kernels
from agentrt.engine.loader import _save_dequantized, load_model
from agentrt.kernels import cpu as kernels_cpu

VOCAB = 512
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}
PROMPT_LENS, DECODE_STEPS = (37, 21), 6


def mixtral_config():
    from transformers import MixtralConfig

    return MixtralConfig(**SMALL, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                         tie_word_embeddings=False, rope_theta=1e6)


def qwen3_moe_config():
    from transformers import Qwen3MoeConfig

    # layer 0 dense (mlp_only_layers), layer 1 a mixture; top-k weights not renormalized
    return Qwen3MoeConfig(**SMALL, head_dim=32, intermediate_size=80, moe_intermediate_size=48, num_experts=4,
                          num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[0], tie_word_embeddings=True)


def qwen2_moe_config():
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(**SMALL, intermediate_size=80, moe_intermediate_size=48, shared_expert_intermediate_size=72,
                          num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False)


def gpt_oss_config():
    from transformers import GptOssConfig

    # sliding (window 8) and full layers alternating, attention sinks, YaRN rope, biased router and experts
    return GptOssConfig(**SMALL, head_dim=16, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                        sliding_window=8, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "original_max_position_embeddings": 64, "truncate": False})


CONFIGS = {"mixtral": mixtral_config, "qwen3_moe": qwen3_moe_config, "qwen2_moe": qwen2_moe_config,
           "gpt_oss": gpt_oss_config}


def make_hf(cfg, seed=0):
    """HF's model of `cfg` with seeded random weights: matrices and expert stacks N(0, 0.08), norms around
    1, biases and sinks N(0, 0.3) (router biases too)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.3)
    return hf


def sequences(seed=3):
    """Two token sequences: prompts of PROMPT_LENS tokens, then DECODE_STEPS more (fed one at a time)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n + DECODE_STEPS,), generator=g).tolist() for n in PROMPT_LENS]


def hf_logits(hf, seqs):
    with torch.no_grad():
        return [hf(torch.tensor([s])).logits[0].float() for s in seqs]


def engine_logits(model, seqs, *, block_size=4, chunk=16):
    """Logits [len, vocab] at every position of each sequence, all sequences in every step: prefill in chunks
    of `chunk` tokens per sequence, then one token per sequence per step, over a paged cache whose block
    tables are shuffled."""
    a, w = model.args, model.embed_tokens.weight
    prompts = [len(s) - DECODE_STEPS for s in seqs]
    blocks_per_seq = -(-max(len(s) for s in seqs) // block_size)
    perm = torch.randperm(len(seqs) * blocks_per_seq, generator=torch.Generator().manual_seed(1))
    tables = perm.view(len(seqs), blocks_per_seq).int()
    kv = torch.zeros(a.num_layers, 2, len(seqs) * blocks_per_seq, block_size, a.num_kv_heads, a.head_dim, dtype=w.dtype)
    done = [0] * len(seqs)
    out = [[] for _ in seqs]
    while any(d < len(s) for d, s in zip(done, seqs)):
        spans = [(d, min(len(s), d + (chunk if d < p else 1))) for d, s, p in zip(done, seqs, prompts)]
        ids = torch.tensor([t for s, (b, e) in zip(seqs, spans) for t in s[b:e]])
        pos = torch.cat([torch.arange(b, e) for b, e in spans])
        seq_of = torch.cat([torch.full((e - b,), i) for i, (b, e) in enumerate(spans)])
        slots = (tables[seq_of, pos // block_size].long() * block_size + pos % block_size)
        qsl = torch.tensor([0] + [e - b for b, e in spans]).cumsum(0)
        lens = torch.tensor([e for _, e in spans])
        meta = kernels.build_attention_metadata(query_start_loc=qsl, seq_lens=lens, block_tables=tables,
                                                max_query_len=max(e - b for b, e in spans), max_seq_len=int(lens.max()))
        with torch.inference_mode():
            logits = model.compute_logits(model(ids, pos, kv, meta, slots)).float()
        for i, (b, e) in enumerate(spans):
            out[i].append(logits[int(qsl[i]):int(qsl[i + 1])])
        done = [e for _, e in spans]
    return [torch.cat(o) for o in out]


def nmse(got, want):
    g, w = torch.cat(got).double(), torch.cat(want).double()
    return float(((g - w) ** 2).sum() / (w**2).sum())


def assert_top5(got, want):
    """vLLM's check_logprobs_close at every position: each side's top token is in the other's top 5."""
    for g, w in zip(got, want):
        g_top, w_top = g.topk(5, dim=-1).indices, w.topk(5, dim=-1).indices
        assert (g_top == g.argmax(-1, keepdim=True)).any(-1).all()
        assert (w_top == g_top[:, :1]).any(-1).all(), "the engine's top token is outside HF's top 5"
        assert (g_top == w_top[:, :1]).any(-1).all(), "HF's top token is outside the engine's top 5"


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf(CONFIGS[request.param]())
    hf.save_pretrained(path)
    return request.param, path, hf


@pytest.mark.parametrize("path_name", ["cpp", "torch", "triton"])
def test_fp32_logits_match_hf(checkpoint, path_name):
    name, path, hf = checkpoint
    if path_name == "cpp" and not kernels_cpu.available():
        pytest.skip("C++ CPU kernels cannot be built here")
    seqs = sequences()
    want = hf_logits(hf, seqs)
    with kernels_cpu.use_cpu_kernels(path_name == "cpp"), kernels.use_backend("triton" if path_name == "triton" else "auto"):
        model, _ = load_model(path, torch.float32, "cpu")
        got = engine_logits(model, seqs)
    assert [g.shape for g in got] == [w.shape for w in want]
    assert nmse(got, want) < 1e-4


def test_packed_experts_serve_alone(checkpoint):
    """On the C++ kernels the experts' packed copy serves alone: after the first forward every mixture layer's
    `w13` / `w2` hold one element (the experts sit in memory once, not twice), the logits are still HF's, and a
    path that would read the dropped weights (the torch path, taken with grad on) is refused by name."""
    from agentrt.engine.moe import SparseMoE

    name, path, hf = checkpoint
    if not kernels_cpu.available():
        pytest.skip("C++ CPU kernels cannot be built here")
    seqs = sequences()
    model, _ = load_model(path, torch.float32, "cpu")
    moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    assert moes and all(m.w13.untyped_storage().nbytes() == m.w13.numel() * 4 for m in moes)
    assert nmse(engine_logits(model, seqs), hf_logits(hf, seqs)) < 1e-4
    for m in moes:
        assert [w.untyped_storage().nbytes() for w in (m.w13, m.w2)] == [4, 4]
        assert m.w13_pack.source_freed and m.w2_pack.source_freed
    with pytest.raises(RuntimeError, match="freed once packed"):
        moes[0](torch.randn(3, model.args.hidden_size))


def test_bf16_top5_rule(checkpoint):
    name, path, hf = checkpoint
    seqs = sequences(seed=4)
    want = hf_logits(make_hf(hf.config).to(torch.bfloat16), seqs)
    model, _ = load_model(path, torch.bfloat16, "cpu")
    got = engine_logits(model, seqs)
    assert nmse(got, want) < 5e-2  # bf16 rounding, not a wrong weight
    assert_top5(got, want)


def test_fused_expert_layout_of_a_gguf_conversion(tmp_path):
    """A GGUF file converts through transformers' in-memory model, whose experts are fused stacks
    (`experts.gate_up_proj` [E, 2I, hidden]), not the per-expert names of a hub checkpoint: both load alike."""
    hf = make_hf(qwen3_moe_config(), seed=5)
    _save_dequantized(hf, tmp_path)
    seqs = sequences(seed=6)
    model, _ = load_model(tmp_path, torch.float32, "cpu")
    assert nmse(engine_logits(model, seqs), hf_logits(hf, seqs)) < 1e-4


def test_gpt_oss_mxfp4_experts_load(tmp_path):
    """gpt-oss ships its experts in MXFP4 (`*_blocks` and `*_scales`, `quant_method: mxfp4`): the loader keeps
    them in their blocks on CPU (tests/engine/test_moe_packed.py), or widens them (`keep_mxfp4=False`). The
    checkpoint here holds the tiny model's experts quantized so; transformers reads the same files (widened,
    `Mxfp4Config(dequantize=True)`) and all give the same logits."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from agentrt.engine.moe import dequantize_mxfp4
    from agentrt.engine.testing import quantize_mxfp4

    hf = make_hf(gpt_oss_config(), seed=7)
    hf.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    for name in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(sd.pop(name).transpose(1, 2))  # stored [E, out, in] in MXFP4
        sd[name + "_blocks"], sd[name + "_scales"] = blocks, scales
        hf.get_parameter(name).data.copy_(dequantize_mxfp4(blocks, scales).transpose(1, 2))  # what they stand for
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    seqs = sequences(seed=8)
    want = hf_logits(hf, seqs)
    for keep in (True, False):
        model, _ = load_model(tmp_path, torch.float32, "cpu", keep_mxfp4=keep)
        assert (model.layers[0].mlp.w13_quant is not None) == (keep and kernels_cpu.available())
        assert nmse(engine_logits(model, seqs), want) < 1e-4
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,  # no hub kernels: widened
                                                  quantization_config=Mxfp4Config(dequantize=True)).eval()
    assert nmse(hf_logits(theirs, seqs), want) < 1e-4


@pytest.mark.parametrize("steps", [1, 4], ids=["step", "multi-step"])
def test_engine_generates_hf_greedy_tokens(tmp_path, steps):
    """Through the whole engine (scheduler, chunked prefill, batched decode, multi-step decode): greedy tokens
    of a Qwen3-MoE equal HF's generate."""
    import os

    from agentrt.engine import LLM, SamplingParams
    from agentrt.engine.loader import load_tokenizer, resolve_model
    from tests.conftest import assert_all_blocks_free

    hf = make_hf(qwen3_moe_config(), seed=9)
    hf.save_pretrained(tmp_path)
    load_tokenizer(resolve_model(os.environ.get("AGENTRT_TEST_TOKENIZER"))).save_pretrained(tmp_path)
    prompts = [s[:n] for s, n in zip(sequences(seed=10) + sequences(seed=11), (5, 23, 40, 12))]
    with torch.no_grad():
        want = []
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                              do_sample=False)
            want.append(out[0, len(p):].tolist())
    llm = LLM(str(tmp_path), num_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
              num_scheduler_steps=steps)
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))]
    assert got == want
    assert_all_blocks_free(llm.core)


def test_lora_on_experts_is_refused_by_name(tmp_path):
    """A LoRA pair on a mixture layer's MLP is refused naming the layer (it would otherwise be ignored);
    attention pairs and the dense layers' MLP pairs pass that check."""
    import os

    from agentrt.engine import LLM, LoRARequest, SamplingParams
    from agentrt.engine.loader import load_tokenizer, resolve_model
    from agentrt.engine.sampling_params import InvalidRequestError
    from agentrt.engine.testing import make_lora_adapter

    hf = make_hf(qwen3_moe_config(), seed=12)  # layer 0 dense, layer 1 a mixture
    hf.save_pretrained(tmp_path / "model")
    load_tokenizer(resolve_model(os.environ.get("AGENTRT_TEST_TOKENIZER"))).save_pretrained(tmp_path / "model")
    adapter = make_lora_adapter(tmp_path / "lora", hf.config, rank=4, targets=("q_proj", "gate_proj"))
    llm = LLM(str(tmp_path / "model"), dtype="float32", num_blocks=16, enable_lora=True, max_lora_rank=8)
    with pytest.raises(InvalidRequestError, match=r"layer 1's MLP, a mixture of experts here"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), lora_request=LoRARequest("a", 1, str(adapter)),
                     progress=False)
