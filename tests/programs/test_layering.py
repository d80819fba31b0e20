"""The layers of DESIGN.md §1, checked on the source: imports point down only.

    agentrt_cli   the `agentrt` command: may import everything
    programs      examples: agentrt's public API (and each other)
    agentrt       the runtime library: engine, never programs / bench / agentrt_cli
    engine        never agentrt;  kernels: never engine
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imports(path: Path) -> list[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]
    return out


def top(name: str) -> str:
    return name.split(".", 1)[0]


FORBIDDEN = {
    "agentrt": {"programs", "bench", "agentrt_cli"},
    "engine": {"agentrt", "programs", "bench", "agentrt_cli"},
    "kernels": {"engine", "agentrt", "programs", "bench", "agentrt_cli"},
    "programs": {"bench", "agentrt_cli", "engine", "kernels"},
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_down(package):
    bad = [(str(f.relative_to(ROOT)), m) for f in sorted((ROOT / package).rglob("*.py"))
           for m in imports(f) if top(m) in FORBIDDEN[package]]
    assert not bad, f"{package}/ imports a higher floor: {bad}"


def test_programs_use_the_public_api_only():
    bad = [(str(f.relative_to(ROOT)), m) for f in sorted((ROOT / "programs").rglob("*.py"))
           for m in imports(f) if m.startswith("agentrt.") and m.split(".")[1].startswith("_")]
    assert not bad, bad


def test_program_and_runtime_modules_do_not_import_each_other():
    assert not [m for m in imports(ROOT / "agentrt" / "_program.py") if m.startswith("agentrt._runtime")]
    assert not [m for m in imports(ROOT / "agentrt" / "_context.py") if m.startswith(("agentrt._runtime", "agentrt._program", "agentrt._client"))]


def test_importing_the_library_loads_no_programs_or_benchmarks():
    code = ("import sys, agentrt, agentrt.server, agentrt.server.app, agentrt.cli; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'programs', 'bench', 'agentrt_cli'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
