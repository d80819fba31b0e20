"""Imports from a source checkout that is not installed (scripts/gpu_check.sh installs nothing).

Every floor imports under `agentrt` (pyproject.toml, [tool.setuptools.package-dir]); an install maps
the three mapped names to their folders. Here a finder does the same from that table: with this folder
on PYTHONPATH, `agentrt.engine` is the checkout's engine/, `agentrt.kernels` its kernels/ and
`agentrt.programs` its programs/ (every other folder is named as it is imported).
"""

import importlib.util
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class CheckoutFinder:
    folders = {name: ROOT / folder for name, folder in
               tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].items()
               if name != folder}

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        folder = cls.folders.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


sys.meta_path.append(CheckoutFinder)
