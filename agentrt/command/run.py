"""`agentrt run FILE`: a program file's `main` inside an in-process runtime, or against a server with
`--url` (the same code either way).

`main` may be `async def` (awaited on the runtime's event loop) or a plain `def` (called in a worker
thread, where `anyio.from_thread.run` reaches the runtime), and take the arguments after `--` or none.
What it returns decides the outcome: None exits 0, an int is the exit code, anything else (the answer
string) is printed and exits 0.
"""

from __future__ import annotations

import ast
import inspect
import os
import runpy
import sys
from collections.abc import Callable
from pathlib import Path

import anyio

import agentrt


def defines_main(source: str) -> bool:
    """True when the module defines `main` (`def` or `async def`) at top level (found without running it)."""
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "main"
               for n in ast.parse(source).body)


def run_file(file: str, args: list[str], *, url: str | None = None, api_key: str | None = None,
             model: str | None = None, policy: str = "plas", policy_kwargs: dict | None = None,
             deterministic: bool | None = None,
             engine: dict | None = None) -> int:
    path = Path(file)
    if not path.is_file():
        print(f"agentrt run: error: no such file: {file}", file=sys.stderr)
        return 2
    try:
        source = path.read_text()
        has_main = defines_main(source)
    except (OSError, UnicodeDecodeError, SyntaxError) as e:
        print(f"agentrt run: error: cannot read {file} as Python: {e}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(path.resolve().parent))  # as `python FILE` does: its neighbours import
    sys.argv = [str(path), *args]
    if not has_main:
        if url is not None:
            print(f"agentrt run: error: --url needs {file} to define `main(argv)` (async or not); it has none",
                  file=sys.stderr)
            return 2
        runpy.run_path(str(path), run_name="__main__")
        return 0
    main = runpy.run_path(str(path), run_name="__agentrt_run__")["main"]
    if not callable(main):
        print(f"agentrt run: error: main in {file} is not a function", file=sys.stderr)
        return 2
    api_key = api_key if api_key is not None else os.environ.get("AGENTRT_API_KEY")
    call = _caller(main, args)

    async def go() -> object:
        if url is not None:
            async with agentrt.connect(url, api_key):
                return await call()
        options = dict(engine or {}, **({} if deterministic is None else {"deterministic": deterministic}))
        async with agentrt.Runtime(model, policy, policy_kwargs=policy_kwargs, **options):
            return await call()

    try:
        result = anyio.run(go)
    except agentrt.AgentrtError as e:
        print(f"agentrt run: error: {e}", file=sys.stderr)
        return 1
    return exit_code(result)


def _caller(main: Callable, args: list[str]) -> Callable[[], object]:
    """An async thunk calling `main` with the arguments, or with none when it takes none."""
    try:
        takes_args = bool(inspect.signature(main).parameters)
    except (TypeError, ValueError):  # a builtin or C callable: give it the arguments
        takes_args = True
    argv = (args,) if takes_args else ()
    if inspect.iscoroutinefunction(main):
        return lambda: main(*argv)
    return lambda: anyio.to_thread.run_sync(lambda: main(*argv))


def exit_code(result: object) -> int:
    """None -> 0, an int -> itself; any other result (an answer) is printed, -> 0."""
    if isinstance(result, int) and not isinstance(result, bool):
        return result
    if result is not None:
        print(result)
    return 0
