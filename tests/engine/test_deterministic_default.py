"""Deterministic (batch-invariant) kernels are the CPU default (issue 48): on for float32 / bfloat16 on CPU
where the C++ kernels build, off on GPU and where they cannot hold; `--no-deterministic` /
`deterministic=False` opts out, `--deterministic` / `deterministic=True` insists (an error where it cannot
hold). The mode's own guarantees: tests/engine/test_deterministic.py."""

import argparse

import pytest

from agentrt._cli_options import add_engine_options, engine_options
from agentrt.engine import LLM, EngineConfig
from agentrt.kernels import cpu


@pytest.mark.parametrize(("dtype", "kw", "want"), [
    ("float32", {}, True), ("bfloat16", {}, True), ("float16", {}, False),  # no C++ float16 kernels: off
    ("float32", {"deterministic": False}, False), ("bfloat16", {"deterministic": True}, True),
])
def test_the_cpu_default_is_deterministic_where_it_holds(dtype, kw, want):
    config = EngineConfig(device="cpu", dtype=dtype, **kw)
    assert config.deterministic is want
    assert config.deterministic_default is ("deterministic" not in kw)


def test_a_bad_value_is_named():
    with pytest.raises(ValueError, match=r"deterministic must be true, false or None \(where it holds\), got 1"):
        EngineConfig(device="cpu", deterministic=1)


@pytest.mark.skipif(not cpu.available(), reason="deterministic mode needs the C++ CPU kernels")
def test_the_engine_starts_batch_invariant_by_default(tiny_model_path):
    llm = LLM(str(tiny_model_path), dtype="float32", num_blocks=16, block_size=4)
    assert llm.core.config.deterministic and llm.core.model.batch_invariant
    assert "deterministic (batch-invariant)" in llm.core.startup_line
    off = LLM(str(tiny_model_path), dtype="float32", num_blocks=16, block_size=4, deterministic=False)
    assert not off.core.model.batch_invariant and "deterministic" not in off.core.startup_line


def test_without_the_cpp_kernels_the_default_turns_off_and_true_is_refused(tiny_model_path):
    with cpu.use_cpu_kernels(False):
        llm = LLM(str(tiny_model_path), dtype="float32", num_blocks=16, block_size=4)
        assert llm.core.config.deterministic is False and not llm.core.model.batch_invariant
        with pytest.raises(ValueError, match="deterministic needs the C.. CPU kernels"):
            LLM(str(tiny_model_path), dtype="float32", num_blocks=16, block_size=4, deterministic=True)


@pytest.mark.parametrize(("argv", "want"), [([], {}), (["--deterministic"], {"deterministic": True}),
                                            (["--no-deterministic"], {"deterministic": False})])
def test_the_flags(argv, want):
    p = argparse.ArgumentParser()
    add_engine_options(p)
    got = {k: v for k, v in engine_options(p.parse_args(argv)).items() if k == "deterministic"}
    assert got == want
