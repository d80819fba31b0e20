"""The house's shape (issue 48): every module's import name is its path but for the three floors the layout
keeps at the top, and no two modules import each other in a circle.

- A folder is its import name: `agentrt.bench.programs` is `agentrt/bench/programs.py`. The layout keeps
  three floors at the repository's top (`kernels/`, `engine/`, `programs/`, imported as `agentrt.kernels`,
  `agentrt.engine`, `agentrt.programs`); those three mappings are stated once, in pyproject.toml's
  `[tool.setuptools.package-dir]`, which the checker reads (docs/architecture.md describes them).
- No import circles, counting every import statement: at the top, inside functions (lazy ones) and under
  `if TYPE_CHECKING:` (a reader and a tool drawing the house follow those too). Two modules that need each
  other get a seam: the shared piece moved down, or a protocol the lower one defines.

Each checker is also run on a small tree made in `tmp_path` that breaks its rule, so a test that passes
here shows the checker can fail.
"""

from __future__ import annotations

import ast
import importlib.util
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOT_PACKAGE = "agentrt"
# The floors the layout requires at the repository's top (DESIGN.md, docs/architecture.md): the only folders
# whose import name is not their path. Anything else mapped in pyproject.toml is a folder misnamed.
TOP_FLOORS = ("engine", "kernels", "programs")


def build_config(root: Path) -> tuple[list[str], dict[str, str]]:
    """pyproject.toml's package list and its name -> folder table."""
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    return list(tool.get("packages", [])), dict(tool.get("package-dir", {}))


def folder_of(name: str, mapping: dict[str, str]) -> Path:
    """Where the import name `name` lives, relative to the root: its longest mapped prefix replaced by that
    folder, the rest of the name as folders (setuptools' rule)."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        prefix = ".".join(parts[:k])
        if prefix in mapping:
            return Path(mapping[prefix], *parts[k:])
    return Path(*parts)


def source_folders(mapping: dict[str, str]) -> list[Path]:
    """The folders that hold the package's source: the root package's and each mapped one's."""
    return [Path(ROOT_PACKAGE), *(Path(f) for f in mapping.values())]


def module_names(root: Path, mapping: dict[str, str]) -> dict[str, Path]:
    """Every module of the package by import name -> its file (relative to the root)."""
    back = {Path(folder): name for name, folder in mapping.items()}
    out = {}
    for top in source_folders(mapping):
        for f in sorted((root / top).rglob("*.py")):
            rel = f.relative_to(root)
            base = next((d for d in back if rel.is_relative_to(d)), None)
            parts = ([*back[base].split("."), *rel.relative_to(base).with_suffix("").parts] if base is not None
                     else list(rel.with_suffix("").parts))
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = rel
    return out


def misnamed(root: Path) -> list[str]:
    """What breaks "a folder is its import name" in the tree at `root` (empty: nothing)."""
    packages, mapping = build_config(root)
    bad = []
    for name, folder in sorted(mapping.items()):
        if name == ROOT_PACKAGE and folder in (ROOT_PACKAGE, f"./{ROOT_PACKAGE}"):
            continue  # the root package where it is anyway: no mapping at all
        if (name != f"{ROOT_PACKAGE}.{folder}" or folder not in TOP_FLOORS):
            bad.append(f"{name} is mapped to the folder {folder}/: only the top floors {', '.join(TOP_FLOORS)} "
                       f"are mapped (as {ROOT_PACKAGE}.<floor>); move it to {'/'.join(name.split('.'))}/")
        if (root / Path(*name.split("."))).is_dir():
            bad.append(f"{name} is mapped to {folder}/ but the folder {'/'.join(name.split('.'))}/ exists too")
    for name in packages:
        if not (root / folder_of(name, mapping) / "__init__.py").is_file():
            bad.append(f"the package {name} has no {folder_of(name, mapping)}/__init__.py")
    names = module_names(root, mapping)
    for name, rel in names.items():
        if rel.name == "__init__.py" and name not in packages:
            bad.append(f"{rel.parent}/ ({name}) is not in pyproject.toml's packages: an install leaves it out")
        expected = folder_of(name, mapping)
        if rel not in (expected / "__init__.py", expected.with_suffix(".py")):
            bad.append(f"{rel} is imported as {name}, which names {expected}")
    return bad


def test_pyproject_maps_the_three_top_floors_only():
    _, mapping = build_config(ROOT)
    assert mapping == {f"{ROOT_PACKAGE}.{f}": f for f in TOP_FLOORS}
    text = (ROOT / "docs" / "architecture.md").read_text()  # where a reader learns them
    for f in TOP_FLOORS:
        assert f"| `{f}/` | `{ROOT_PACKAGE}.{f}` |" in text, f


def test_every_module_is_named_by_its_path():
    assert misnamed(ROOT) == []


def test_the_import_system_finds_each_package_in_its_folder():
    """What an import really resolves to (the editable install's finder, or the installed wheel's layout)
    agrees with the table: `agentrt.bench` is agentrt/bench/, `agentrt.engine` engine/."""
    packages, mapping = build_config(ROOT)
    for name in packages:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations, name
        assert Path(spec.submodule_search_locations[0]).resolve() == (ROOT / folder_of(name, mapping)).resolve(), name


def make_tree(root: Path, files: dict[str, str], package_dir: dict[str, str], packages: list[str]) -> Path:
    table = "".join(f'"{k}" = "{v}"\n' for k, v in package_dir.items())
    (root / "pyproject.toml").write_text(f"[tool.setuptools]\npackages = {packages!r}\n\n"
                                         f"[tool.setuptools.package-dir]\n{table}")
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


GOOD = {"agentrt/__init__.py": "", "agentrt/bench/__init__.py": "", "agentrt/bench/run.py": "",
        "engine/__init__.py": "", "engine/core.py": ""}


def test_the_name_checker_passes_a_well_named_tree(tmp_path):
    tree = make_tree(tmp_path, GOOD, {"agentrt.engine": "engine"}, ["agentrt", "agentrt.bench", "agentrt.engine"])
    assert misnamed(tree) == []
    assert module_names(tree, {"agentrt.engine": "engine"}) == {
        "agentrt": Path("agentrt/__init__.py"), "agentrt.bench": Path("agentrt/bench/__init__.py"),
        "agentrt.bench.run": Path("agentrt/bench/run.py"), "agentrt.engine": Path("engine/__init__.py"),
        "agentrt.engine.core": Path("engine/core.py")}


def test_the_name_checker_fails_on_a_folder_mapped_beside_its_name(tmp_path):
    """The house before issue 48: bench/ imported as agentrt.bench."""
    files = {**{k: v for k, v in GOOD.items() if not k.startswith("agentrt/bench")},
             "bench/__init__.py": "", "bench/run.py": ""}
    tree = make_tree(tmp_path, files, {"agentrt.engine": "engine", "agentrt.bench": "bench"},
                     ["agentrt", "agentrt.bench", "agentrt.engine"])
    (problem,) = misnamed(tree)
    assert problem.startswith("agentrt.bench is mapped to the folder bench/") and "agentrt/bench/" in problem


def test_the_name_checker_fails_on_a_floor_mapped_under_another_name(tmp_path):
    tree = make_tree(tmp_path, {**GOOD, "engine2/__init__.py": ""}, {"agentrt.engine": "engine2"},
                     ["agentrt", "agentrt.bench", "agentrt.engine"])
    bad = misnamed(tree)
    assert any(p.startswith("agentrt.engine is mapped to the folder engine2/") for p in bad), bad


def test_the_name_checker_fails_on_a_package_left_out_of_the_list(tmp_path):
    tree = make_tree(tmp_path, GOOD, {"agentrt.engine": "engine"}, ["agentrt", "agentrt.engine"])
    assert misnamed(tree) == ["agentrt/bench/ (agentrt.bench) is not in pyproject.toml's packages: an install "
                              "leaves it out"]


# --- no circles ------------------------------------------------------------------------------------------


def imported_modules(path: Path, name: str, modules: set[str]) -> set[str]:
    """The package's modules the file `path` (module `name`) imports, by any import statement anywhere in it:
    `from a import b` counts as the module `a.b` when there is one, else `a`; relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            for a in node.names:
                target = f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                if target in modules:
                    found.add(target)
    return found - {name}


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    _, mapping = build_config(root)
    names = module_names(root, mapping)
    return {name: imported_modules(root / rel, name, set(names)) for name, rel in names.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), each
    sorted: every set of modules that reach one another through their imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next((m for m in edges if m in graph), None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def describe(graph: dict[str, set[str]], component: list[str]) -> str:
    members = set(component)
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & members))}" for m in component)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT)


def test_no_import_circles(graph):
    assert len(graph) > 150 and "agentrt.bench.simulate" in graph  # the whole package was read
    found = circles(graph)
    assert not found, "import circles (move the shared piece down or give the lower module a protocol):\n" + \
        "\n".join(describe(graph, c) for c in found)


def test_the_circle_checker_finds_lazy_and_type_checking_circles(tmp_path):
    files = {
        "agentrt/__init__.py": "",
        "agentrt/a.py": "def f():\n    from agentrt.b import g\n    return g()\n",  # lazy, inside a function
        "agentrt/b.py": "from agentrt import c\n\ndef g():\n    return c\n",  # `from package import module`
        "agentrt/c.py": "from . import a\n",  # relative
        "agentrt/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from agentrt.e import E\n",
        "agentrt/e.py": "import agentrt.d\nE = 1\n",
        "agentrt/f.py": "import agentrt.a\nimport json\nfrom agentrt.missing import x\n",  # into a circle: not in one
        "engine/__init__.py": "", "engine/core.py": "from agentrt.engine import util\n", "engine/util.py": "",
    }
    tree = make_tree(tmp_path, files, {"agentrt.engine": "engine"}, ["agentrt", "agentrt.engine"])
    graph = import_graph(tree)
    assert graph["agentrt.engine.core"] == {"agentrt.engine.util"} and graph["agentrt.f"] == {"agentrt.a"}
    assert circles(graph) == [["agentrt.a", "agentrt.b", "agentrt.c"], ["agentrt.d", "agentrt.e"]]
    assert describe(graph, ["agentrt.d", "agentrt.e"]) == "agentrt.d -> agentrt.e; agentrt.e -> agentrt.d"


def test_the_circle_checker_passes_a_tree_without_circles(tmp_path):
    files = {"agentrt/__init__.py": "", "agentrt/a.py": "from agentrt import b\n",
             "agentrt/b.py": "def g():\n    from agentrt import c\n", "agentrt/c.py": "import os\n"}
    graph = import_graph(make_tree(tmp_path, files, {}, ["agentrt"]))
    assert graph == {"agentrt": set(), "agentrt.a": {"agentrt.b"}, "agentrt.b": {"agentrt.c"}, "agentrt.c": set()}
    assert circles(graph) == []


@pytest.mark.parametrize("pair", [("agentrt._beam", "agentrt._runtime"), ("agentrt._call", "agentrt._programs"),
                                  ("agentrt.bench.programs", "agentrt.bench.simulate"),
                                  ("agentrt.bench.sim_replicas", "agentrt.bench.simulate")])
def test_the_circles_of_issue_48_stay_broken(graph, pair):
    """Each pair now imports one way only: the lower module defines a protocol (`_beam.BeamRuntime`,
    `_call.CallReports`) or the shared piece moved down (the simulator's run, agentrt/bench/sim_run.py)."""
    low, high = pair
    assert high not in graph[low], f"{low} imports {high}"
