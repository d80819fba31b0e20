"""What someone coming from vLLM types first: `RequestOutput.prompt`, `LLM(gpu_memory_utilization=...,
tensor_parallel_size=1)`, a hub id (refused with the way to fetch it), and the start-up line on stderr."""

import pytest

from agentrt.engine import LLM, EngineConfig, SamplingParams
from agentrt.engine.config import available_host_bytes, kv_budget
from agentrt.engine.loader import ModelNotFoundError, resolve_model
from agentrt.engine.runner import ModelRunner

GREEDY = SamplingParams(max_tokens=2, temperature=0)


def test_request_output_prompt_is_the_text_or_none_for_token_ids(tiny_model_path):
    llm = LLM(str(tiny_model_path), num_blocks=32, block_size=4)
    text, ids = llm.generate(["Hello there", [1, 2, 3]], GREEDY)
    assert (text.prompt, ids.prompt) == ("Hello there", None)
    conv = [{"role": "user", "content": "Hi"}]
    chat = llm.chat(conv, GREEDY)[0]
    assert chat.prompt == llm.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)


def test_gpu_memory_utilization_sizes_the_kv_cache_from_available_host_memory():
    cfg = EngineConfig(device="cpu", gpu_memory_utilization=0.001)
    budget, source = kv_budget(cfg)
    assert abs(budget - available_host_bytes() * 0.001) < available_host_bytes() * 0.0002  # memory moves a bit
    assert source == "gpu_memory_utilization 0.001 of available host memory"
    assert kv_budget(EngineConfig(device="cpu")) == (1 << 30, "the CPU default")
    assert kv_budget(EngineConfig(device="cpu", kv_cache_bytes=12345)) == (12345, "kv_cache_bytes")


def test_llm_takes_vllm_keywords_and_the_start_up_line_goes_to_stderr(tiny_model_path, capfd):
    llm = LLM(str(tiny_model_path), gpu_memory_utilization=0.0005, tensor_parallel_size=1, dtype="float32")
    per_block = ModelRunner.bytes_per_block(llm.core.model.args, 16, llm.core.config.torch_dtype)
    expected = available_host_bytes() * 0.0005 / per_block  # available memory moves a little meanwhile
    assert abs(llm.core.kv.num_blocks - expected) <= 0.05 * expected + 1
    err = capfd.readouterr().err
    line = llm.core.startup_line
    assert line in err and "float32 (set by dtype)" in line and "policy fcfs" in line
    assert "from gpu_memory_utilization 0.0005 of available host memory" in line and "MiB" in line


@pytest.mark.parametrize("kw, message", [
    (dict(gpu_memory_utilization=0.0), r"gpu_memory_utilization must be a fraction in \(0, 1\], got 0.0"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be a fraction in \(0, 1\], got 1.5"),
    (dict(gpu_memory_utilization=0.5, kv_cache_bytes=1 << 20), "give kv_cache_bytes or gpu_memory_utilization"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size must be 1, got 2: an engine runs on one device"),
])
def test_vllm_keywords_out_of_range_say_why(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(device="cpu", **kw)


def test_a_hub_id_says_models_are_not_downloaded():
    with pytest.raises(ModelNotFoundError, match=r"unknown model path 'HuggingFaceTB/SmolLM2-360M-Instruct'.*"
                       r"looks like a Hugging Face hub id, and models are not downloaded here.*"
                       r"huggingface-cli download"):
        resolve_model("HuggingFaceTB/SmolLM2-360M-Instruct")
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("/nope/model.gguf")
    assert "hub id" not in str(e.value)
