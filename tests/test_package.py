"""One package name: every floor installs under `agentrt`, beside Hugging Face's `kernels` package and
the newest transformers (scripts/setup.sh installs both, so CI's whole suite runs in that environment)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ("agentrt/engine/", "agentrt/kernels/", "agentrt/programs/", "agentrt/bench/", "agentrt/command/")


def test_hugging_face_kernels_beside_ours():
    import agentrt.kernels
    import kernels

    assert Path(agentrt.kernels.__file__).parent == ROOT / "kernels"
    assert Path(kernels.__file__).resolve().parent != (ROOT / "kernels").resolve()
    assert importlib.metadata.version("kernels")  # Hugging Face's distribution, installed
    assert callable(kernels.get_kernel)
    from transformers import LlamaForCausalLM  # imports HF's `kernels` on transformers >= 5.25

    assert LlamaForCausalLM.__name__ == "LlamaForCausalLM"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, text=True)
    (whl,) = out.glob("agentrt-*.whl")
    return whl


def test_wheel_has_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names if not n.startswith("agentrt-")}
    assert tops == {"agentrt"}
    for floor in FLOORS:
        assert any(n.startswith(floor) for n in names), floor
    assert "agentrt/kernels/csrc/cpu_ops.cpp" in names  # the C++ kernels build from the installed copy
    root = Path(__file__).resolve().parents[1]
    for init in root.glob("agentrt/*/__init__.py"):  # every subpackage of the runtime floor ships
        assert f"agentrt/{init.parent.name}/__init__.py" in names, init.parent.name
    assert any(n.startswith("agentrt/programs/data/") for n in names)
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "agentrt = agentrt.command:main" in entry


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed into a directory of its own (not the source tree): its `site` folder."""
    target = tmp_path_factory.mktemp("installed") / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True)
    return target


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["bench", "programs", "--help"]],
                         ids=" ".join)
def test_installed_command_runs(installed, tmp_path, argv):
    """The wheel's `agentrt` script, run from outside the tree, loads the command and its benchmarks from
    the installed copy."""
    script = installed / "bin" / "agentrt"
    assert script.exists(), sorted(p.name for p in installed.iterdir())
    code = ("import sys, runpy; sys.argv = ['agentrt', *sys.argv[1:]]; import agentrt.command as c; "
            f"assert c.__file__.startswith({str(installed)!r}), c.__file__; runpy.run_path({str(script)!r}, "
            "run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(installed)}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: agentrt"), done.stdout[:500]


def test_no_folder_outside_its_import_name():
    """`bench/` and `agentrt_cli/` moved under `agentrt/` (issue 48): nothing in the tree names them."""
    assert not (ROOT / "bench").exists() and not (ROOT / "agentrt_cli").exists()
    found = subprocess.run(["git", "grep", "-n", "-E", r"agentrt_cli|(^|[^/A-Za-z_.-])bench/", "--", ".",
                            ":!tests/test_package.py", ":!tests/programs/test_layering.py"],
                           capture_output=True, text=True, cwd=ROOT)
    if found.returncode == 128:
        pytest.skip(f"not a git checkout: {found.stderr.strip()}")
    assert found.stdout == "", found.stdout[:2000]


def test_installed_copy_generates_beside_hf_kernels(installed, tmp_path, tiny_model_path):
    """The wheel installed into its own directory (not the source tree) loads a model and generates,
    with Hugging Face's `kernels` importable as `kernels` in the same process."""
    target = installed
    code = (
        "import kernels, agentrt, agentrt.engine as e\n"
        f"assert agentrt.__file__.startswith({str(target)!r}), agentrt.__file__\n"
        "assert callable(kernels.get_kernel)\n"
        f"llm = e.LLM({str(tiny_model_path)!r}, num_blocks=32, block_size=4)\n"
        "out = llm.generate([[1, 2, 3, 4]], e.SamplingParams(max_tokens=5, ignore_eos=True))\n"
        "print(len(out[0].outputs[0].token_ids))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "5"
