"""agentrt.bench.random_gguf: random weights in Qwen3's shapes as a GGUF file that agentrt loads. The Q4_K_M step
needs llama.cpp's quantizer, never a dependency: its test runs where $AGENTRT_LLAMA_PYTHON names an interpreter
that imports llama_cpp (e.g. /work/llamacpp/bin/python), and is skipped elsewhere (CI)."""

import os

import pytest
import torch

from agentrt.bench import random_gguf as rg
from tests.conftest import requires_default_model

# Qwen3-0.6B's widths (q 2048 wide over a hidden size of 1024, head_dim 128) cut to 2 layers and 1024 tokens: the
# same tensors as Qwen3-4B's file, 65 MB of F16
SMALL = {"shape": "qwen3-0.6b", "layers": 2, "vocab_size": 1024}


def test_qwen3_4b_is_the_issues_shape():
    cfg = rg.qwen3_config("qwen3-4b")
    assert type(cfg).__name__ == "Qwen3Config"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size, cfg.max_position_embeddings) == (
                2560, 9728, 36, 32, 8, 128, 151936, 40960)
    assert cfg.tie_word_embeddings and cfg.rms_norm_eps == 1e-6 and cfg.rope_parameters["rope_theta"] == 1e6
    plan = dict(rg.tensor_plan(cfg))  # from the meta device: no weights
    assert len(plan) == 2 + 11 * 36 and "output.weight" not in plan  # tied: the head is the embedding
    assert plan["token_embd.weight"] == (151936, 2560) and plan["blk.35.attn_q.weight"] == (4096, 2560)
    assert plan["blk.0.attn_k.weight"] == (1024, 2560) and plan["blk.0.ffn_down.weight"] == (2560, 9728)
    assert plan["blk.0.attn_q_norm.weight"] == (128,)
    assert sum(torch.Size(s).numel() for s in plan.values()) == 4_022_468_096  # Qwen3-4B's parameters
    assert rg.file_name("qwen3-4b", cfg, 0, "Q4_K_M") == "random-qwen3-4b-36L-seed0.Q4_K_M.gguf"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"shape": "llama-3.1-8b"}, "unknown shape 'llama-3.1-8b'"),
    ({"layers": 37}, "layers 37 is not between 1 and qwen3-4b's 36"),
    ({"ftype": "Q4_K_M", "llama_python": None}, "Q4_K_M is made by llama.cpp's quantizer: no --llama-python given"),
])
def test_bad_requests_say_what_is_wrong(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        rg.random_gguf(**{"shape": "qwen3-4b", "out": tmp_path, "ftype": "F16", **kwargs}, log=lambda _: None)
    assert not list(tmp_path.iterdir())  # nothing left behind


@requires_default_model
def test_vocabulary_keeps_its_byte_alphabet():
    with pytest.raises(ValueError, match="would cut .* byte alphabet or special tokens \\(it needs at least 252\\)"):
        rg.donor_tokenizer(rg.default_gguf_path(), 200)


@requires_default_model
def test_f16_file_loads_in_agentrt_with_the_configs_shapes(tmp_path, monkeypatch):
    import gguf

    from agentrt.engine.loader import load_model, load_tokenizer, resolve_model

    monkeypatch.setenv("AGENTRT_CACHE_DIR", str(tmp_path / "cache"))  # the converted copy
    logs = []
    path = rg.random_gguf(**SMALL, out=tmp_path, seed=3, ftype="F16", log=logs.append)
    assert path.name == "random-qwen3-0.6b-2L-v1024-seed3.F16.gguf" and [p.name for p in tmp_path.iterdir()
                                                                           if p.is_file()] == [path.name]
    assert rg.tensor_types(path) == {"F16": 2 * 7 + 1, "F32": 2 * 4 + 1}  # projections + embedding; norms
    mtime = path.stat().st_mtime_ns
    assert rg.random_gguf(**SMALL, out=tmp_path, seed=3, ftype="F16", log=logs.append) == path
    assert path.stat().st_mtime_ns == mtime and logs[-1].startswith("random_gguf: reusing")

    cfg = rg.qwen3_config(**SMALL)
    model, hf_config = load_model(resolve_model(path), torch.float32, "cpu")
    a = model.args
    assert hf_config.model_type == "qwen3"
    assert (a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.vocab_size) == (
        2, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, 128, 1024)
    q, kv = cfg.num_attention_heads * 128, cfg.num_key_value_heads * 128
    layer = model.layers[1]
    assert model.embed_tokens.weight.shape == (1024, cfg.hidden_size) and model.lm_head is None  # tied
    assert layer.self_attn.qkv_proj.weight.shape == (q + 2 * kv, cfg.hidden_size)
    assert layer.self_attn.o_proj.weight.shape == (cfg.hidden_size, q)
    assert layer.mlp.gate_up_proj.weight.shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    assert layer.mlp.down_proj.weight.shape == (cfg.hidden_size, cfg.intermediate_size)
    # the file's values, through transformers' conversion (F16 widens exactly)
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in gguf.GGUFReader(path).tensors}
    assert torch.equal(model.embed_tokens.weight, tensors["token_embd.weight"].float())
    assert torch.equal(layer.mlp.down_proj.weight, tensors["blk.1.ffn_down.weight"].float())
    assert abs(tensors["blk.1.ffn_up.weight"].float().std().item() - rg.STD) < 1e-3
    assert torch.equal(tensors["blk.1.attn_k_norm.weight"], torch.ones(128))
    tok = load_tokenizer(resolve_model(path))
    ids = tok(rg.PROMPT, add_special_tokens=False)["input_ids"]
    assert len(tok) == 1024 and max(ids) < 1024 and tok.decode(ids) == rg.PROMPT


def _llama_python() -> str | None:
    from agentrt.bench.quant import llama_cpp_missing

    python = os.environ.get("AGENTRT_LLAMA_PYTHON")
    return python if python and llama_cpp_missing(python) is None else None


@requires_default_model
@pytest.mark.skipif(_llama_python() is None, reason="no $AGENTRT_LLAMA_PYTHON importing llama_cpp (llama.cpp's "
                                                    "quantizer is the benchmark's peer, not a dependency)")
def test_q4_k_m_file_loads_in_both_peers(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRT_CACHE_DIR", str(tmp_path / "cache"))
    path = rg.random_gguf(**SMALL, out=tmp_path, llama_python=_llama_python(), log=lambda _: None)
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == [path.name]  # the F16 intermediate deleted
    types = rg.tensor_types(path)
    assert set(types) == {"Q4_K", "Q6_K", "F32"} and types["Q6_K"] >= 1  # the tied embedding at least
    peer, ours = rg.check_llama_cpp(_llama_python(), path), rg.check_agentrt(path)
    assert (peer["n_layer"], peer["n_vocab"]) == (ours["n_layer"], ours["n_vocab"]) == (2, 1024)
    assert peer["prompt_ids"] == ours["prompt_ids"]  # one tokenizer
    assert "weights: gguf Q4_K+Q6_K kept packed" in ours["startup_line"]
    assert len(peer["greedy"]) == len(ours["greedy"]) == 4
