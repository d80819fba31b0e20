"""A checkout's `kernels/` folder found by its folder name, not as `agentrt.kernels`.

`python -m ...` or `python -c ...` run from the repository root puts the root on `sys.path`, where this
floor's folder `kernels/` would shadow Hugging Face's `kernels` package (which transformers >= 5.25
imports). Imported under that name, the folder hands the name over: it loads the first `kernels`
found elsewhere on `sys.path` in its place or, with none, an empty namespace (what a stray folder on
`sys.path` is to Python; transformers reads that as "not installed"). agentrt itself always
imports this floor as `agentrt.kernels` (tests/programs/test_layering.py).

The standard library only: the interpreter that finds the folder may have no agentrt installed
(vLLM's, a notebook's), so `kernels/__init__.py` imports this module relatively, as `kernels._folder_name`
(tests/test_package.py runs it in a venv without agentrt).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path


def hand_over(name: str = "kernels") -> None:
    """Replace `sys.modules[name]` (this folder, being imported) with the package of that name found
    on `sys.path` outside the checkout, or with an empty namespace package when there is none."""
    checkout = Path(__file__).resolve().parents[1]
    path = [p for p in sys.path if Path(p or ".").resolve() != checkout]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = []
    module = importlib.util.module_from_spec(spec)
    if __name__ == f"{name}.{__name__.rpartition('.')[2]}":  # this module, loaded as the folder's: not the new one's
        sys.modules.pop(__name__, None)
    if spec.loader is None:
        del module.__file__  # as None it breaks inspect.getmodule, which torch calls on import
        sys.modules[name] = module
        return
    sys.modules[name] = module
    spec.loader.exec_module(module)
