"""agentrt bench quant: its table and its argument checks (the runs themselves are a benchmark, not a test)."""

import pytest

from agentrt.bench import quant


def _run(mode, single, batched, peak):
    return {"mode": mode, "weights": "gguf Q4_1 kept packed, 96 MB" if mode == "packed" else "widened to bfloat16",
            "dtype": "bfloat16", "cpu_kind": "avx2", "threads": 2, "rss_loaded_mb": 600.0, "rss_end_mb": 610.0,
            "rss_peak_mb": peak, "single_tok_s": single, "batched_tok_s": batched}


def test_table_gives_each_mode_against_the_widened_one():
    result = {"model": "m.gguf", "prompt_len": 32, "max_tokens": 128, "concurrency": 32, "kv_mib": 64, "repeats": 2,
              "runs": [_run("packed", 30.0, 120.0, 800.0), _run("widened", 60.0, 100.0, 1400.0)]}
    md = quant.markdown(result)
    assert "| packed | gguf Q4_1 kept packed, 96 MB | avx2 | 2 | 600 | 800 | 30.0 | 0.50x | 120.0 | 1.20x |" in md
    assert "| widened | widened to bfloat16 | avx2 | 2 | 600 | 1,400 | 60.0 | 1.00x | 100.0 | 1.00x |" in md
    assert "llama.cpp" in md  # says the peer is not measured yet


def test_table_gives_the_llama_cpp_row_and_the_ratios_against_it():
    peer = {**_run("llama.cpp", 40.0, 50.0, 300.0), "weights": "llama-cpp-python 0.3, mmap", "cpu_kind": "llama.cpp"}
    result = {"model": "m.gguf", "prompt_len": 32, "max_tokens": 128, "concurrency": 32, "kv_mib": 64, "repeats": 2,
              "runs": [_run("packed", 30.0, 120.0, 800.0), _run("widened", 60.0, 100.0, 1400.0), peer],
              "llama_cpp_skipped": None, "isa_env": "avx2"}
    md = quant.markdown(result)
    assert "| packed | gguf Q4_1 kept packed, 96 MB | avx2 | 2 | 600 | 800 | 30.0 | 0.50x | 120.0 | 1.20x | 0.75x | 2.40x |" in md
    assert ("| llama.cpp | llama-cpp-python 0.3, mmap | llama.cpp | 2 | 600 | 300 | 40.0 | 0.67x | "
            "50.0 | 0.50x | 1.00x | 1.00x |") in md
    assert "`AGENTRT_CPU_ISA=avx2`" in md


def test_llama_cpp_row_is_skipped_with_its_reason(tmp_path):
    assert "no --llama-python given" in quant.llama_cpp_missing(None)
    assert "cannot run" in quant.llama_cpp_missing(str(tmp_path / "no-python"))
    import importlib.util
    import sys

    if importlib.util.find_spec("llama_cpp") is None:  # agentrt's venv: llama_cpp is never a dependency
        assert "cannot import llama_cpp" in quant.llama_cpp_missing(sys.executable)
    reason = "--llama-python 'x' cannot import llama_cpp (ModuleNotFoundError)"
    result = {"model": "m.gguf", "prompt_len": 32, "max_tokens": 128, "concurrency": 32, "kv_mib": 64, "repeats": 2,
              "runs": [_run("packed", 30.0, 120.0, 800.0), _run("widened", 60.0, 100.0, 1400.0)],
              "llama_cpp_skipped": reason}
    assert f"llama.cpp row left out: {reason}." in quant.markdown(result)


@pytest.mark.parametrize(("argv", "message"), [(["--threads", "0"], "--threads must be >= 1, got 0"),
                                               (["--model", "x.safetensors"], "--model must be a .gguf file"),
                                               (["--modes", "packed,int3"], "--modes: unknown mode 'int3'")])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        quant.main(argv)
    assert message in capsys.readouterr().err
