"""The layers of DESIGN.md §1, checked on the source: imports point down only.

Every floor imports under the one name `agentrt` (docs/architecture.md); a floor is its folder:

    agentrt/command/  agentrt.command    the `agentrt` command: may import everything
    agentrt/bench/    agentrt.bench      benchmarks: everything but the command
    programs/         agentrt.programs   examples: agentrt's public API (and each other)
    agentrt/          agentrt            the runtime library: engine, never programs / bench / command
    engine/           agentrt.engine     never the runtime;  kernels/ agentrt.kernels: never engine

Import names and paths, and the absence of import circles, are checked in tests/test_house.py.
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


FOLDERS = {"agentrt.kernels": "kernels", "agentrt.engine": "engine", "agentrt.programs": "programs",
           "agentrt.bench": "agentrt/bench", "agentrt.command": "agentrt/command"}
OLD_NAMES = {"kernels", "engine", "programs", "bench", "agentrt_cli"}  # before one package name


def floor(name: str) -> str | None:
    """The folder (floor) a module name lives in; None outside the project and for the root package
    `agentrt` itself, which every floor shares (its `__init__` imports nothing until a name is used)."""
    for package, folder in FOLDERS.items():
        if name == package or name.startswith(package + "."):
            return folder
    return "agentrt" if name.startswith("agentrt.") else None


def files(folder: str) -> list[Path]:
    """A floor's source files: its folder's, less those of a floor inside it (agentrt/bench/ in agentrt/)."""
    inner = [ROOT / f for f in FOLDERS.values() if f.startswith(folder + "/")]
    return [f for f in sorted((ROOT / folder).rglob("*.py")) if not any(f.is_relative_to(d) for d in inner)]


BENCH, COMMAND = FOLDERS["agentrt.bench"], FOLDERS["agentrt.command"]
FORBIDDEN = {
    "agentrt": {"programs", BENCH, COMMAND},
    "engine": {"agentrt", "programs", BENCH, COMMAND},
    "kernels": {"engine", "agentrt", "programs", BENCH, COMMAND},
    "programs": {BENCH, COMMAND, "engine", "kernels"},
    BENCH: {COMMAND},
}


def test_floors_map_to_folders():
    assert floor("agentrt.engine.scheduler") == "engine" and floor("agentrt.engineering") == "agentrt"
    assert floor("agentrt.kernels") == "kernels" and floor("agentrt._runtime") == "agentrt"
    assert floor("agentrt") is None and floor("kernels") is None
    assert floor("agentrt.bench.programs") == "agentrt/bench" and floor("agentrt.command") == "agentrt/command"
    assert ROOT / "agentrt" / "bench" / "programs.py" not in files("agentrt")
    assert ROOT / "agentrt" / "bench" / "programs.py" in files("agentrt/bench")


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_down(package):
    bad = [(str(f.relative_to(ROOT)), m) for f in files(package) for m in imports(f) if floor(m) in FORBIDDEN[package]]
    assert not bad, f"{package}/ imports a higher floor: {bad}"


def test_no_floor_is_imported_by_its_folder_name():
    """`import engine` would load a second copy of the floor beside `agentrt.engine` (and `kernels` is
    Hugging Face's package): every import names the floor under `agentrt`."""
    found = [f for d in (*FOLDERS.values(), "agentrt", "tests") for f in files(d)
             if f.name not in ("test_package.py", "test_house.py")]  # those import HF's `kernels` on purpose
    bad = [(str(f.relative_to(ROOT)), m) for f in found for m in imports(f) if m.split(".", 1)[0] in OLD_NAMES]
    assert not bad, bad


def test_programs_use_the_public_api_only():
    bad = [(str(f.relative_to(ROOT)), m) for f in sorted((ROOT / "programs").rglob("*.py"))
           for m in imports(f) if m.startswith("agentrt.") and m.split(".")[1].startswith("_")]
    assert not bad, bad


def test_program_and_runtime_modules_do_not_import_each_other():
    assert not [m for m in imports(ROOT / "agentrt" / "_program.py") if m.startswith("agentrt._runtime")]
    assert not [m for m in imports(ROOT / "agentrt" / "_context.py") if m.startswith(("agentrt._runtime", "agentrt._program", "agentrt._client"))]


def test_importing_the_library_loads_no_programs_or_benchmarks():
    code = ("import sys, agentrt, agentrt.server, agentrt.server.app, agentrt.cli; "
            "print(sorted(m for m in sys.modules if m.startswith(('agentrt.programs', 'agentrt.bench', "
            "'agentrt.command', 'programs', 'bench', 'engine', 'kernels.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_importing_the_engine_loads_no_runtime():
    """`agentrt/__init__` loads its public names lazily: the engine floor imports as `agentrt.engine`
    without the runtime or its server-side dependencies (the GPU image has torch, triton and
    transformers only)."""
    code = ("import sys, agentrt.engine, agentrt.kernels; "
            "print(sorted(m for m in sys.modules if (m.startswith('agentrt.') and "
            "not m.startswith(('agentrt.engine', 'agentrt.kernels'))) "
            "or m.split('.')[0] in ('msgspec', 'sqlalchemy', 'starlette', 'uvicorn')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


ABOVE_ENGINE = ("agentrt", COMMAND, "programs")  # agentrt/bench/ aside: benchmarks drive the core directly
RUNTIME_NAMES = {"runtime", "rt"}  # what code above the engine calls a Runtime


def reaches_below(source: str, name: str = "<sample>") -> list[str]:
    """Each `x.core` (the engine's core, behind its client: engine.client, AsyncEngine) and each `_`-name read
    off something named runtime (`runtime._engine()`, `self.runtime._x`, `st.runtime._x`): `name:line expr`."""
    bad = []
    for node in ast.walk(ast.parse(source, name)):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        owner_name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else None
        if node.attr == "core" or (node.attr.startswith("_") and not node.attr.startswith("__")
                                   and owner_name in RUNTIME_NAMES):
            bad.append((node.lineno, node.col_offset, f"{name}:{node.lineno} {ast.unparse(node)}"))
    return [b for *_, b in sorted(bad)]


def test_reaching_below_is_caught():
    code = ("engine.core.kv\nself.runtime._engine()\nst.runtime._inflight\nrt._result(out)\n"
            "self._engine\nruntime.engine_info\nruntime.__class__\n")
    found = [line.split(" ", 1)[1] for line in reaches_below(code)]
    assert found == ["engine.core", "self.runtime._engine", "st.runtime._inflight", "rt._result"]


def test_nothing_above_the_engine_reaches_into_its_core_or_the_runtime_privates():
    """Above `engine/`, the engine is reached through `AsyncEngine` (info, stats, operations), never its core;
    and the runtime through its public methods (DESIGN.md §5, "the engine client")."""
    bad = [b for d in ABOVE_ENGINE for f in files(d)
           for b in reaches_below(f.read_text(), str(f.relative_to(ROOT)))]
    assert not bad, bad


def test_server_modules_do_not_import_the_app_factory():
    """`agentrt/server/app.py` builds the app from the route modules; none of them imports it back (the
    shared state, config and body helpers live in their own modules). The package's `__init__` is its public
    face: it hands out `create_app`, loading the module on use."""
    server = ROOT / "agentrt" / "server"
    bad = [(f.name, m) for f in sorted(server.rglob("*.py")) if f.name not in ("app.py", "__init__.py")
           for m in imports(f) if m == "agentrt.server.app" or m.startswith("agentrt.server.app.")]
    assert not bad, bad
