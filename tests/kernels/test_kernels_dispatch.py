"""Backend selection, the public surface of `kernels`, and its import boundary."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentrt import kernels

dispatch = importlib.import_module("agentrt.kernels._dispatch")


@pytest.fixture(autouse=True)
def fresh_backend(monkeypatch):
    monkeypatch.setattr(dispatch, "_backend", None)
    monkeypatch.delenv("AGENTRT_KERNEL_BACKEND", raising=False)


def spy_calls(monkeypatch) -> list[str]:
    calls: list[str] = []
    for name in ("store_kv_triton", "store_kv_ref"):
        real = getattr(dispatch, name)
        monkeypatch.setattr(dispatch, name, lambda *a, _n=name, _r=real: (calls.append(_n), _r(*a)))
    return calls


def store_args():
    cache = torch.zeros(2, 16, 2, 64)
    return torch.ones(3, 2, 64), torch.ones(3, 2, 64), cache, cache.clone(), torch.tensor([0, 5, -1])


def test_all_is_sorted_and_exported():
    assert kernels.__all__ == sorted(kernels.__all__)
    assert all(hasattr(kernels, name) for name in kernels.__all__)
    public = {n for n in vars(kernels) if not n.startswith("_")}
    assert public <= set(kernels.__all__)


def test_auto_uses_torch_on_cpu_even_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls = spy_calls(monkeypatch)
    assert kernels.get_backend() == "auto"
    kernels.store_kv(*store_args())
    assert calls == ["store_kv_ref"]


def test_use_backend_switches_and_restores(monkeypatch):
    calls = spy_calls(monkeypatch)
    kernels.set_backend("torch")
    with kernels.use_backend("triton"):
        assert kernels.get_backend() == "triton"
        kernels.store_kv(*store_args())
    assert kernels.get_backend() == "torch"
    kernels.store_kv(*store_args())
    assert calls == ["store_kv_triton", "store_kv_ref"]


def test_env_var_selects_backend(monkeypatch):
    monkeypatch.setenv("AGENTRT_KERNEL_BACKEND", "torch")
    assert kernels.get_backend() == "torch"


@pytest.mark.parametrize("how", ["set_backend", "use_backend", "env"])
def test_invalid_backend_names_itself(monkeypatch, how):
    with pytest.raises(ValueError, match="'cuda'"):
        if how == "set_backend":
            kernels.set_backend("cuda")
        elif how == "use_backend":
            with kernels.use_backend("cuda"):
                pass
        else:
            monkeypatch.setenv("AGENTRT_KERNEL_BACKEND", "cuda")
            kernels.get_backend()


def test_forced_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with kernels.use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.store_kv(*store_args())


def test_dispatched_ops_agree_across_backends():
    kv_cache = torch.randn(2, 2, 4, 16, 2, 64)
    mapping = torch.tensor([[1, 3]])
    results = []
    for backend in ("torch", "triton"):
        cache = kv_cache.clone()
        key = torch.randn(5, 2, 64, generator=torch.Generator().manual_seed(1))
        value = key * 2
        with kernels.use_backend(backend):
            kernels.store_kv(key, value, cache[0, 0], cache[0, 1], torch.tensor([16, 17, 18, -1, 0]))
            kernels.copy_blocks(cache, mapping)
            meta = kernels.build_attention_metadata(torch.tensor([0, 3]), torch.tensor([19]),
                                                    torch.tensor([[2, 1, 0]]), 3, 19)
            q = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(2))
            results.append((cache, kernels.paged_attention(q, cache[0, 0], cache[0, 1], meta, 0.125)))
    assert torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-5)


def test_build_attention_metadata_validates():
    with pytest.raises(ValueError, match="block_tables"):
        kernels.build_attention_metadata(torch.tensor([0, 1]), torch.tensor([4]), torch.zeros(2, 3), 1, 4)
    with pytest.raises(ValueError, match="query_start_loc"):
        kernels.build_attention_metadata(torch.tensor([0]), torch.tensor([4]), torch.zeros(1, 3), 1, 4)
    meta = kernels.build_attention_metadata(torch.tensor([0, 1]), torch.tensor([4]), torch.zeros(1, 3), 1, 4)
    assert meta.block_tables.dtype == meta.seq_lens.dtype == meta.query_start_loc.dtype == torch.int32


def test_kernels_import_only_torch_and_triton():
    code = ("import sys, agentrt.kernels; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('engine', 'programs', 'bench', 'msgspec', 'anyio') or (m.startswith('agentrt.') "
            "and not m.startswith('agentrt.kernels'))); print(bad); sys.exit(1 if bad else 0)")
    repo = Path(kernels.__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo)
    assert result.returncode == 0, result.stdout + result.stderr
