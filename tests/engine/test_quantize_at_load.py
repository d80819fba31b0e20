"""quantization="int8" | "int4": a safetensors model's projections quantized at load to blocks of 32 (Q8_0 / Q4_1)
and run by the packed kernels (engine.gguf_weights.quantize_model)."""

from collections import Counter

import pytest
import torch

from agentrt.engine import LLM, EngineConfig, SamplingParams
from agentrt.engine.loader import load_model, resolve_model
from tests.conftest import requires_default_model
from tests.engine.test_dense_architectures import engine_logits

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "The three primary colors are",
           "Once upon a time, a small robot", "To make a cup of tea, first", "The largest planet in our solar system",
           "In 1969, astronauts"]


@pytest.fixture(scope="module")
def widened():
    model, _ = load_model(resolve_model(None), torch.bfloat16, "cpu")
    return model


@requires_default_model
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_greedy_tokens_are_in_the_bf16_top5(scheme, widened):
    # acceptance: every greedy token of the quantized engine is among the bf16 engine's 5 best at its position
    # (the bf16 model teacher-forced on the quantized one's output), on 8 prompts
    llm = LLM(None, quantization=scheme, dtype="bfloat16", num_blocks=64)
    fmt = {"int8": "Q8_0", "int4": "Q4_1"}[scheme]
    layers = llm.core.model.args.num_layers
    packed = llm.core.model.packed_weights
    # q/k/v, o, gate/up, down (4 fused projections) per layer, and the tied embedding / LM head in Q8_0
    assert packed.formats == (Counter({fmt: 4 * layers, "Q8_0": 1}) if fmt != "Q8_0" else Counter({fmt: 4 * layers + 1}))
    assert f"weights: {scheme} (" in llm.core.startup_line and "blocks of 32) kept packed" in llm.core.startup_line
    assert llm.core.model.layers[0].mlp.down_proj.weight.numel() == 0  # the widened copy dropped
    ids = [llm.tokenizer(p)["input_ids"] for p in PROMPTS]
    outs = llm.generate(ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), progress=False)
    for p, o in zip(ids, outs):
        tokens = p + o.token_ids
        logits = engine_logits(widened, tokens, len(p), 8)
        top5 = logits[len(p) - 1 : len(tokens) - 1].topk(5, dim=-1).indices
        assert all(t in row for t, row in zip(o.token_ids, top5.tolist())), (scheme, PROMPTS[ids.index(p)])


def test_quantize_config_refusals():
    with pytest.raises(ValueError, match="got 'int3'"):
        EngineConfig(quantization="int3", device="cpu")
    with pytest.raises(ValueError, match="quantization='int4' does not serve LoRA adapters yet"):
        EngineConfig(quantization="int4", device="cpu", enable_lora=True)
