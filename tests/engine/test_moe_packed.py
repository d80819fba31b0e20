"""A mixture's experts kept in blocks on CPU (engine.moe `SparseMoE.expert_blocks`): gpt-oss's MXFP4 experts as
the checkpoint ships them (the default; `quantization="none"` widens), and `quantization="int8" | "int4"`
quantizing a safetensors MoE's experts per expert (Q8_0 / Q4_1) with the rest of its projections. Tiny seeded
checkpoints from transformers' own config classes (tests/engine/test_moe_models.py)."""

import os

import pytest
import torch

from agentrt.engine import LLM, SamplingParams
from agentrt.engine.loader import load_model, load_tokenizer, resolve_model
from agentrt.engine.moe import SparseMoE
from agentrt.engine.testing import save_mxfp4_experts
from agentrt.kernels import cpu
from tests.engine.test_dense_architectures import engine_logits as one_sequence_logits
from tests.engine.test_moe_models import engine_logits, gpt_oss_config, make_hf, nmse, sequences

pytestmark = pytest.mark.skipif(not cpu.available(), reason="experts stay in blocks where the C++ kernels are built")


def _moe_layers(model) -> list[SparseMoE]:
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    """A tiny gpt-oss whose experts the checkpoint holds in MXFP4 (`*_blocks` / `*_scales`), with a tokenizer."""
    path = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    cfg = gpt_oss_config()
    cfg.intermediate_size = 96  # w2's K: three 32-weight blocks
    save_mxfp4_experts(make_hf(cfg, seed=21), path)
    load_tokenizer(resolve_model(os.environ.get("AGENTRT_TEST_TOKENIZER"))).save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_experts_kept_packed_match_the_widened_engine(gpt_oss_mxfp4, dtype):
    packed, _ = load_model(gpt_oss_mxfp4, dtype, "cpu")
    widened, _ = load_model(gpt_oss_mxfp4, dtype, "cpu", keep_mxfp4=False)
    for moe in _moe_layers(packed):  # ggml's MXFP4 blocks, gate rows then up rows; no widened copy
        assert moe.w13_quant.format_name == moe.w2_quant.format_name == "MXFP4"
        assert moe.w13_quant.shape == (4, 2 * 96, 64) and moe.w2_quant.shape == (4, 64, 96)
        assert moe.w13.numel() == moe.w2.numel() == 0
    assert all(moe.w13_quant is None and moe.w13.shape == (4, 2 * 96, 64) for moe in _moe_layers(widened))
    w = packed.packed_weights
    assert w.source == "experts" and dict(w.expert_formats) == {"MXFP4": 4}
    assert w.expert_bytes == 2 * 4 * (2 * 96 * 64 + 64 * 96) // 32 * 17
    assert w.describe().startswith(f"experts MXFP4 kept packed, {w.expert_bytes / 1e6:.0f} MB")
    assert widened.packed_weights is None
    seqs = sequences(seed=22)
    assert nmse(engine_logits(packed, seqs), engine_logits(widened, seqs)) < 1e-4


def test_mxfp4_engine_greedy_tokens_equal_widened(gpt_oss_mxfp4):
    kw = {"dtype": "float32", "num_blocks": 64, "block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 4}
    packed, widened = LLM(str(gpt_oss_mxfp4), **kw), LLM(str(gpt_oss_mxfp4), quantization="none", **kw)
    assert "weights: experts MXFP4 kept packed" in packed.core.startup_line
    assert "weights: widened to float32" in widened.core.startup_line
    prompts = [s[:n] for s, n in zip(sequences(seed=23) * 2, (5, 23, 17, 30))]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in packed.generate(prompts, params, progress=False)]
    assert [len(t) for t in got] == [10] * len(prompts)
    assert got == [o.token_ids for o in widened.generate(prompts, params, progress=False)]


def qwen3_moe_int8_config():
    from transformers import Qwen3MoeConfig

    from tests.engine.test_moe_models import SMALL

    # layer 0 dense (mlp_only_layers), layer 1 a mixture; every projection's K a multiple of 32
    return Qwen3MoeConfig(**SMALL, head_dim=32, intermediate_size=96, moe_intermediate_size=64, num_experts=4,
                          num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0], tie_word_embeddings=False)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-moe")
    make_hf(qwen3_moe_int8_config(), seed=24).save_pretrained(path)
    load_tokenizer(resolve_model(os.environ.get("AGENTRT_TEST_TOKENIZER"))).save_pretrained(path)
    return path


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_experts_compute_with_their_blocks(qwen3_moe, scheme):
    """The mixture layer with experts quantized at load gives what the widened layer gives with the blocks'
    decoded values as its weights (fp32: the same weights, sums in another order)."""
    from agentrt.kernels.quant import dequantize_ref

    packed, _ = load_model(qwen3_moe, torch.float32, "cpu", quantize=scheme)
    widened, _ = load_model(qwen3_moe, torch.float32, "cpu")
    (moe,), (ref,) = _moe_layers(packed), _moe_layers(widened)
    with torch.no_grad():
        for q, w in ((moe.w13_quant, ref.w13), (moe.w2_quant, ref.w2)):
            decoded = torch.stack([dequantize_ref(q.expert(e)) for e in range(q.shape[0])])
            assert (decoded - w.double()).abs().max() > 0  # quantization changed the weights the layer had
            w.copy_(decoded)
        x = torch.randn(19, 64, generator=torch.Generator().manual_seed(27))
        assert nmse([moe(x)], [ref(x)]) < 1e-10


def test_int8_moe_greedy_tokens_are_in_the_bf16_top5(qwen3_moe):
    """Every greedy token of the int8 engine is among the bf16 engine's 5 best at its position (the bf16 model
    teacher-forced on the quantized one's output), experts quantized per expert with the rest."""
    scheme, fmt = "int8", "Q8_0"
    llm = LLM(str(qwen3_moe), quantization=scheme, dtype="bfloat16", num_blocks=64, block_size=4)
    (moe,) = _moe_layers(llm.core.model)
    assert moe.w13_quant.format_name == moe.w2_quant.format_name == fmt and moe.w13.numel() == 0
    assert moe.router.weight.numel() > 0  # the router stays widened
    packed = llm.core.model.packed_weights
    assert dict(packed.expert_formats) == {fmt: 2}
    assert packed.expert_bytes == moe.w13_quant.nbytes + moe.w2_quant.nbytes
    # attention's 2 fused projections per layer, layer 0's dense MLP (2), the LM head, the embedding (Q8_0), experts
    assert packed.formats[fmt] == 2 * 2 + 2 + 1 + 2 + 1
    assert f"weights: {scheme} (" in llm.core.startup_line and f"{fmt} experts" in llm.core.startup_line
    widened, _ = load_model(qwen3_moe, torch.bfloat16, "cpu")
    prompts = [s[:n] for s, n in zip(sequences(seed=25) * 4, (5, 23, 9, 30, 14, 3, 19, 26))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), progress=False)
    for p, o in zip(prompts, outs):
        assert len(o.token_ids) == 10, o.finish_reason
        tokens = p + o.token_ids
        logits = one_sequence_logits(widened, tokens, len(p), 8)
        top5 = logits[len(p) - 1 : len(tokens) - 1].topk(5, dim=-1).indices
        assert all(t in row for t, row in zip(o.token_ids, top5.tolist())), (scheme, p)


def test_quantize_refuses_experts_off_the_blocks(tmp_path):
    from transformers import Qwen3MoeConfig

    from tests.engine.test_moe_models import SMALL

    cfg = Qwen3MoeConfig(**SMALL, head_dim=32, intermediate_size=96, moe_intermediate_size=48, num_experts=4,
                         num_experts_per_tok=2, tie_word_embeddings=False)
    make_hf(cfg, seed=26).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp: experts in Q8_0 blocks.*gate/up take 64, down 48"):
        load_model(tmp_path, torch.bfloat16, "cpu", quantize="int8")


def test_gguf_packing_refuses_a_mixture_by_name(qwen3_moe, tmp_path):
    """`quantization="gguf"` keeps a GGUF file's own blocks; a mixture's experts in a GGUF file are not kept yet:
    refused naming the layer (not an AttributeError)."""
    gguf = pytest.importorskip("gguf")
    from agentrt.engine.gguf_weights import pack_model

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen3moe")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 64).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model, _ = load_model(qwen3_moe, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"layers.1.mlp.gate_up_proj is not a plain projection \(a GGUF file's "):
        pack_model(model, tmp_path / "m.gguf")
