"""One package name: every floor installs under `agentrt`, beside Hugging Face's `kernels` package and
the newest transformers (scripts/setup.sh installs both, so CI's whole suite runs in that environment)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import sysconfig
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
                            ":!tests/test_package.py", ":!tests/programs/test_layering.py", ":!tests/test_house.py"],
                           capture_output=True, text=True, cwd=ROOT)
    if found.returncode == 128:
        pytest.skip(f"not a git checkout: {found.stderr.strip()}")
    assert found.stdout == "", found.stdout[:2000]


def test_installed_copy_generates_beside_hf_kernels(installed, tmp_path, tiny_model_path):
    """The wheel installed into its own directory (not the source tree) loads a model and generates,
    with Hugging Face's `kernels` importable as `kernels` in the same process."""
    from agentrt.kernels import cpu

    target = installed
    built = cpu.library_path(cpu.kind()) if cpu.ops() else None
    before = built.stat().st_mtime_ns if built else None
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
    if built:  # the copy found the library this checkout built (same sources) instead of building it again
        assert built.stat().st_mtime_ns == before


def bare_venv(root: Path, *, hf_kernels: bool) -> Path:
    """A venv beside no agentrt: this interpreter's base Python, its site-packages the test venv's
    packages (torch, transformers, ...) linked one by one, less agentrt's (its metadata and the editable
    install's finder) and, unless `hf_kernels`, less Hugging Face's `kernels`. Its python."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    ours = Path(sysconfig.get_paths()["purelib"])
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for entry in ours.iterdir():
        name = entry.name.lower()
        if name.startswith(("agentrt", "__editable__")) or (not hf_kernels and name.split("-")[0] == "kernels"):
            continue
        (site / entry.name).symlink_to(entry)
    return python


@pytest.mark.parametrize("hf_kernels", [True, False], ids=["with-hf-kernels", "no-hf-kernels"])
def test_checkout_kernels_folder_hands_over_without_agentrt(tmp_path, hf_kernels):
    """Another interpreter started in the repository root (vLLM's, a notebook's) finds the folder kernels/
    first when transformers imports `kernels`: the folder hands the name over with the standard library
    alone (issue 48: it imported `agentrt.kernels`, which such a venv lacks). With Hugging Face's package
    that is loaded and transformers' model code imports; without it `kernels` is an empty namespace."""
    python = bare_venv(tmp_path / "venv", hf_kernels=hf_kernels)
    code = [
        "import importlib.util, sys",
        "assert importlib.util.find_spec('agentrt.kernels') is None, 'agentrt is installed here'",
        "import kernels",
        f"assert not (getattr(kernels, '__file__', None) or '').startswith({str(ROOT / 'kernels')!r}), kernels",
        "assert not [m for m in sys.modules if m.startswith('kernels._folder_name')]",
        *(["assert callable(kernels.get_kernel)", "import transformers.activations",
           "assert 'kernels' in sys.modules and sys.modules['kernels'] is kernels"] if hf_kernels else
          ["assert getattr(kernels, '__file__', None) is None and list(kernels.__path__) == []"]),
        "print('ok')",
    ]
    done = subprocess.run([str(python), "-c", "\n".join(code)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
