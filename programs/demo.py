"""`agentrt demo`: the example programs, concurrently, on the in-process engine."""

from __future__ import annotations

import argparse
import time

import anyio

import agentrt
from programs.chat import chat_session
from programs.react import react
from programs.tree_search import tree_search


async def _main(model: str | None, policy: str) -> None:
    async with agentrt.Runtime(model=model, policy=policy):
        t = time.perf_counter()
        results: dict[str, object] = {}

        async def run(name, fn, *args):
            results[name] = await fn(*args)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "chat", chat_session, ["What is the capital of France?", "And of Italy?"])
            tg.start_soon(run, "react", react, "What is 17 * 23?")
            tg.start_soon(run, "tree_search", tree_search, "write a haiku about the sea")
        for name, value in results.items():
            print(f"--- {name}\n{value}\n")
        print(f"{len(results)} programs in {time.perf_counter() - t:.1f}s (policy={policy})")
        for info in agentrt.process_table():
            print(f"  {info.name:12s} calls={info.calls_done:2d} service={info.service_s:.2f}s "
                  f"wait={info.wait_s:.2f}s tokens={info.num_output_tokens}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt demo")
    ap.add_argument("--model", default=None)
    ap.add_argument("--policy", default="plas")
    a = ap.parse_args(argv)
    anyio.run(_main, a.model, a.policy)
    return 0
