"""`agentrt demo`: the example programs, concurrently, against a server on the default model.

By default it starts `agentrt serve` on a free loopback port, runs the programs through
`agentrt.connect` (the same code that runs in-process), prints each program's record as the
server keeps it (GET /v1/programs/{id}), and stops the server with SIGTERM (it drains and exits 0).
`--url` uses a server that is already running; `--in-process` runs on an in-process engine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import anyio
import httpx

import agentrt
from programs.chat import chat_session
from programs.react import react
from programs.tree_search import tree_search


async def _programs() -> dict[str, object]:
    results: dict[str, object] = {}

    async def run(name, fn, *args):
        results[name] = await fn(*args)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "chat", chat_session, ["What is the capital of France?", "And of Italy?"])
        tg.start_soon(run, "react", react, "What is 17 * 23?")
        tg.start_soon(run, "tree_search", tree_search, "write a haiku about the sea")
    return results


def _print(results: dict[str, object], elapsed_s: float, where: str) -> None:
    for name, value in results.items():
        print(f"--- {name}\n{value}\n")
    print(f"{len(results)} programs in {elapsed_s:.1f}s ({where})")


async def _remote(url: str, api_key: str | None) -> None:
    t = time.perf_counter()
    async with agentrt.connect(url, api_key) as rt:
        results = await _programs()
        ids = [info.program_id for info in rt.programs]
    _print(results, time.perf_counter() - t, f"through {url}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers) as client:
        for pid in ids:
            r = await client.get(f"/v1/programs/{pid}")
            if r.status_code == 200:
                p = r.json()
                print(f"  {p['id']:24s} {p['state']:9s} calls={p['calls_done']:2d} service={p['service_s']:.2f}s "
                      f"wait={p['wait_s']:.2f}s tokens={p['num_output_tokens']}")


async def _in_process(model: str | None, policy: str) -> None:
    t = time.perf_counter()
    async with agentrt.Runtime(model=model, policy=policy):
        results = await _programs()
        _print(results, time.perf_counter() - t, f"in-process, policy={policy}")
        for info in agentrt.process_table():
            print(f"  {info.name:12s} calls={info.calls_done:2d} service={info.service_s:.2f}s "
                  f"wait={info.wait_s:.2f}s tokens={info.num_output_tokens}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _server(model: str | None, policy: str, timeout_s: float = 600.0) -> Iterator[str]:
    """`agentrt serve` in a child process; yields its URL; SIGTERM at the end (it must exit 0)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "agentrt.cli", "serve", "--port", str(port), "--policy", policy, "--db", "none",
           "--log-level", "warning"]
    if model:
        cmd += ["--model", model]
    print(f"starting: agentrt serve --port {port} --policy {policy} (loading the model)", file=sys.stderr)
    proc = subprocess.Popen(cmd, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"agentrt serve exited with code {proc.returncode} before it was ready")
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"agentrt serve did not become ready within {timeout_s:.0f}s")
            time.sleep(0.25)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            print(f"server stopped (exit code {code})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt demo", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--policy", default="plas", choices=["plas", "atlas", "mlfq", "fcfs"])
    ap.add_argument("--url", default=None, help="run against this running server instead of starting one")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--in-process", action="store_true", help="run on an in-process engine, no server")
    a = ap.parse_args(argv)
    if a.in_process:
        anyio.run(_in_process, a.model, a.policy)
    elif a.url:
        anyio.run(_remote, a.url, a.api_key)
    else:
        with _server(a.model, a.policy) as url:
            anyio.run(_remote, url, None)
    return 0
