"""`agentrt run FILE`: a program file's `async def main(argv)` inside an in-process runtime, or
against a server with `--url` (the same code either way)."""

from __future__ import annotations

import ast
import inspect
import os
import runpy
import sys
from pathlib import Path

import anyio

import agentrt


def defines_async_main(source: str) -> bool:
    """True when the module defines `async def main` at top level (found without running it)."""
    return any(isinstance(n, ast.AsyncFunctionDef) and n.name == "main" for n in ast.parse(source).body)


def run_file(file: str, args: list[str], *, url: str | None = None, api_key: str | None = None,
             model: str | None = None, policy: str = "plas") -> int:
    path = Path(file)
    if not path.is_file():
        print(f"agentrt run: error: no such file: {file}", file=sys.stderr)
        return 2
    try:
        source = path.read_text()
        has_main = defines_async_main(source)
    except (OSError, UnicodeDecodeError, SyntaxError) as e:
        print(f"agentrt run: error: cannot read {file} as Python: {e}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(path.resolve().parent))  # as `python FILE` does: its neighbours import
    sys.argv = [str(path), *args]
    if not has_main:
        if url is not None:
            print(f"agentrt run: error: --url needs {file} to define `async def main(argv)`; it has none",
                  file=sys.stderr)
            return 2
        runpy.run_path(str(path), run_name="__main__")
        return 0
    main = runpy.run_path(str(path), run_name="__agentrt_run__")["main"]
    if not inspect.iscoroutinefunction(main):
        print(f"agentrt run: error: main in {file} is not an async function", file=sys.stderr)
        return 2
    api_key = api_key if api_key is not None else os.environ.get("AGENTRT_API_KEY")

    async def go() -> object:
        if url is not None:
            async with agentrt.connect(url, api_key):
                return await main(args)
        async with agentrt.Runtime(model, policy):
            return await main(args)

    try:
        rc = anyio.run(go)
    except agentrt.AgentrtError as e:
        print(f"agentrt run: error: {e}", file=sys.stderr)
        return 1
    return rc if isinstance(rc, int) else 0
