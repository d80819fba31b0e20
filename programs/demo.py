"""`agentrt demo`: a concurrent mix of MCTS, ReAct and chat programs on the default model, with a
live table of the runtime's programs, then a summary.

By default it starts `agentrt serve` on a free loopback port, runs the programs through
`agentrt.connect` (the same code that runs in-process) and reads the table from the server
(`GET /v1/programs`, `GET /metrics`); at the end it stops the server with SIGTERM (it drains and
exits 0), or with `--keep` leaves it and its live page (`/ui`) up until Ctrl-C. `--url` uses a server
that is already running; `--in-process` runs on an in-process engine and reads the runtime's process
table directly.

Columns: state, calls (waiting / running / done), threads, attained service (executor seconds),
queueing time, queue level (PLAS), KV blocks held now (and pinned, where the runtime reports pins),
prompt tokens served from the prefix cache.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

import agentrt
from agentrt.programs.chat import chat_session
from agentrt.programs.countdown import PUZZLES
from agentrt.programs.mcts import mcts
from agentrt.programs.react import react

CHATS = [["What is the capital of France?", "And of Italy?"], ["Name a fruit.", "What colour is it?"],
         ["What is a haiku?", "Write one about the sea."]]
QUESTIONS = ["What is 17 * 23?", "How tall is Mount Everest?", "What is the weather in Tokyo?"]
MCTS_PUZZLES = [PUZZLES[6], PUZZLES[19], PUZZLES[7]]


@dataclass
class Row:
    id: str
    name: str
    state: str
    calls: str  # waiting / running / done
    threads: int
    service_s: float
    wait_s: float
    queue_level: int | None
    kv_held: int | None
    kv_pinned: int | None  # None: the runtime reports no pins
    prefix_hits: int | None


# --- where the table comes from -------------------------------------------------------------------
class InProcessView:
    """The in-process runtime's process table and engine."""

    def __init__(self, rt: agentrt.Runtime) -> None:
        self.rt = rt

    async def rows(self) -> list[Row]:
        rt = self.rt
        rows = []
        for p in rt.programs:
            running = p.state == "running"
            kv = rt.program_kv(p.program_id) if running else p.kv  # an ended program's record holds nothing
            rows.append(Row(p.program_id, p.name, p.state, f"{p.calls_waiting}/{p.calls_running}/{p.calls_done}",
                            p.num_threads, p.service_s, p.wait_s, rt.program_queue_level(p.program_id),
                            rt.program_kv_blocks(p.program_id) if running else 0,
                            None if kv is None else kv.pinned, p.num_prefix_hit_tokens))
        return rows

    async def totals(self) -> dict[str, float]:
        kv = self.rt.kv_stats()
        return {"kv_usage": 1 - kv.num_free_blocks / kv.num_blocks, "prefix_queries": kv.prefix_queries_tokens,
                "prefix_hits": kv.prefix_hit_tokens, "preemptions": kv.num_preemptions,
                "dedup_merges": kv.dedup_merges, "shared_blocks": kv.num_shared_blocks}


class ServerView:
    """A server's view of this client's programs: GET /v1/programs and /metrics."""

    def __init__(self, rt: agentrt.RemoteRuntime, client: httpx.AsyncClient) -> None:
        self.rt = rt
        self.client = client

    async def rows(self) -> list[Row]:
        mine = {p.program_id: p for p in self.rt.programs}
        r = await self.client.get("/v1/programs", params={"limit": 1000})
        r.raise_for_status()
        seen = {p["id"]: p for p in r.json()["data"] if p["id"] in mine}
        rows = []
        for pid, info in mine.items():
            p = seen.get(pid)
            if p is None:  # no call reached the server yet
                rows.append(Row(pid, info.name, info.state, "0/0/0", 1, 0.0, 0.0, None, None, None, None))
                continue
            rows.append(Row(pid, p["name"] if p["name"] != "program" else info.name, p["state"],
                            f"{p['calls_waiting']}/{p['calls_running']}/{p['calls_done']}", p["num_threads"],
                            p["service_s"], p["wait_s"], p["queue_level"], p["kv_blocks"], p.get("kv_blocks_pinned"),
                            p.get("num_prefix_hit_tokens")))
        return rows

    async def totals(self) -> dict[str, float]:
        r = await self.client.get("/metrics")
        r.raise_for_status()
        m = parse_metrics(r.text)
        return {"kv_usage": m.get("agentrt:kv_cache_usage_perc", 0.0),
                "prefix_queries": m.get("agentrt:prefix_cache_queries_total", 0.0),
                "prefix_hits": m.get("agentrt:prefix_cache_hits_total", 0.0),
                "preemptions": m.get("agentrt:num_preemptions_total", 0.0)}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {name: value summed over labels}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def render(rows: list[Row], totals: dict[str, float], elapsed_s: float, where: str) -> Group:
    t = Table(title=f"agentrt demo ({where}), {elapsed_s:.0f} s", title_justify="left")
    for col in ("program", "name", "state", "calls w/r/done", "threads", "service s", "wait s", "queue", "KV held",
                "KV pinned", "prefix hits"):
        t.add_column(col, justify="left" if col in ("program", "name", "state") else "right", no_wrap=True)
    for r in rows:
        style = {"running": "green", "failed": "red", "cancelled": "red"}.get(r.state, "dim")
        t.add_row(r.id, r.name, Text(r.state, style=style), r.calls, str(r.threads), f"{r.service_s:.2f}",
                  f"{r.wait_s:.2f}", _dash(r.queue_level), _dash(r.kv_held), _dash(r.kv_pinned), _dash(r.prefix_hits))
    q = totals.get("prefix_queries", 0)
    line = (f"KV in use {100 * totals.get('kv_usage', 0):.1f}%   prefix cache hits "
            f"{100 * totals.get('prefix_hits', 0) / q if q else 0:.0f}% of {int(q)} prompt tokens   "
            f"preemptions {int(totals.get('preemptions', 0))}")
    return Group(t, Text(line))


def _dash(v: Any) -> str:
    return "-" if v is None else str(v)


# --- the programs -----------------------------------------------------------------------------------
def mix(a: argparse.Namespace) -> list[tuple[str, Callable[[], Any]]]:
    jobs: list[tuple[str, Callable[[], Any]]] = []
    for i in range(a.mcts):
        p = MCTS_PUZZLES[i % len(MCTS_PUZZLES)]
        jobs.append((f"mcts {p}", lambda p=p, i=i: mcts(p, budget=a.budget, width=a.width, seed=i)))
    for i in range(a.react):
        q = QUESTIONS[i % len(QUESTIONS)]
        jobs.append((f"react: {q}", lambda q=q: react(q, max_steps=a.max_steps)))
    for i in range(a.chat):
        turns = CHATS[i % len(CHATS)]
        jobs.append((f"chat: {' / '.join(turns)}", lambda turns=turns: chat_session(turns, max_tokens=a.chat_tokens)))
    return jobs


def describe(result: Any) -> str:
    if hasattr(result, "solved"):  # MCTSResult
        steps = "; ".join(f"{s.a} {s.op} {s.b} = {s.result}" for s in result.steps) or "-"
        return (f"{'solved' if result.solved else 'not solved'} (verified): {steps}  "
                f"[{result.calls} calls, {result.expansions} expansions, {result.pruned} malformed proposals]")
    if hasattr(result, "tool_calls"):  # ReActResult
        tools = ", ".join(f"{t}[{arg}]" for t, arg, _ in result.tool_calls) or "no tool"
        return f"{result.answer or '(no answer)'}  [{result.steps} LLM calls; {tools}]"
    if isinstance(result, list):  # chat
        return " / ".join(r.strip().replace("\n", " ")[:80] for r in result)
    return str(result)


async def run_mix(a: argparse.Namespace, view: InProcessView | ServerView, where: str, console: Console) -> int:
    jobs = mix(a)
    results: dict[int, Any] = {}
    t0 = time.perf_counter()
    done = anyio.Event()

    async def one(i: int, job: Callable[[], Any]) -> None:
        try:
            results[i] = await job()
        except agentrt.AgentrtError as e:  # one program's failure is reported, not fatal to the others
            results[i] = e

    async def snapshot() -> Group:
        return render(await view.rows(), await view.totals(), time.perf_counter() - t0, where)

    async def monitor(live: Live | None) -> None:
        while not done.is_set():
            with anyio.move_on_after(a.refresh):
                await done.wait()
            if live is not None and not done.is_set():
                live.update(await snapshot())

    live_ctx = Live(console=console, refresh_per_second=4, transient=False) if a.live else contextlib.nullcontext()
    with live_ctx as live:
        async with anyio.create_task_group() as tg:
            tg.start_soon(monitor, live)
            async with anyio.create_task_group() as programs:
                for i, (_, job) in enumerate(jobs):
                    programs.start_soon(one, i, job)
            done.set()
        final = await snapshot()
        if live is not None:
            live.update(final)
    if live is None:
        console.print(final)
    console.print(f"\n[bold]summary[/bold]: {len(jobs)} programs in {time.perf_counter() - t0:.1f} s ({where})")
    failed = 0
    for i, (label, _) in enumerate(jobs):
        r = results.get(i)
        failed += isinstance(r, BaseException) or r is None
        console.print(f"  {label}\n    -> {describe(r)}", highlight=False, markup=False, soft_wrap=True)
    return 1 if failed else 0


# --- modes --------------------------------------------------------------------------------------------
async def _remote(a: argparse.Namespace, url: str, console: Console) -> int:
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    async with agentrt.connect(url, a.api_key) as rt, httpx.AsyncClient(base_url=url, headers=headers) as client:
        return await run_mix(a, ServerView(rt, client), f"through {url}", console)


async def _in_process(a: argparse.Namespace, console: Console) -> int:
    async with agentrt.Runtime(model=a.model, policy=a.policy) as rt:
        return await run_mix(a, InProcessView(rt), f"in-process, policy {a.policy}", console)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    """The demo's `agentrt serve` child: its URL and process."""

    url: str
    proc: subprocess.Popen

    def wait_for_ctrl_c(self) -> None:
        """Until Ctrl-C (or the server exits by itself): `--keep`."""
        print(f"the server stays up: live page {self.url}/ui, API {self.url}/v1; Ctrl-C stops it", file=sys.stderr,
              flush=True)
        try:
            while self.proc.poll() is None:
                time.sleep(0.25)
        except KeyboardInterrupt:  # the terminal's Ctrl-C reaches the server too: it drains and exits 0
            pass


@contextlib.contextmanager
def server(model: str | None, policy: str, timeout_s: float = 600.0) -> Iterator[Served]:
    """`agentrt serve` in a child process, ready; SIGTERM at the end unless it stopped already (it must exit 0)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "agentrt.cli", "serve", "--port", str(port), "--policy", policy, "--db", "none",
           "--log-level", "warning"]
    if model:
        cmd += ["--model", model]
    print(f"starting: agentrt serve --port {port} --policy {policy} (loading the model); "
          f"live page: http://127.0.0.1:{port}/ui", file=sys.stderr)
    proc = subprocess.Popen(cmd, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"agentrt serve exited with code {proc.returncode} before it was ready")
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"agentrt serve did not become ready within {timeout_s:.0f}s")
            time.sleep(0.25)
        yield Served(url, proc)
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
    ap.add_argument("--api-key", default=os.environ.get("AGENTRT_API_KEY"), help="API key for --url")
    ap.add_argument("--in-process", action="store_true", help="run on an in-process engine, no server")
    ap.add_argument("--mcts", type=int, default=2, help="MCTS programs (Countdown puzzles)")
    ap.add_argument("--react", type=int, default=3, help="ReAct programs")
    ap.add_argument("--chat", type=int, default=2, help="chat programs")
    ap.add_argument("--budget", type=int, default=8, help="LLM calls per MCTS program")
    ap.add_argument("--width", type=int, default=4, help="parallel proposals per MCTS expansion")
    ap.add_argument("--max-steps", type=int, default=5, help="LLM calls per ReAct program at most")
    ap.add_argument("--chat-tokens", type=int, default=32, help="tokens per chat answer at most")
    ap.add_argument("--refresh", type=float, default=0.5, help="seconds between table updates")
    ap.add_argument("--no-live", dest="live", action="store_false", help="print the table once, at the end")
    ap.add_argument("--keep", action="store_true",
                    help="at the end, keep the server it started and its live page (/ui) up until Ctrl-C")
    a = ap.parse_args(argv)
    if min(a.mcts, a.react, a.chat) < 0 or a.mcts + a.react + a.chat == 0:
        ap.error("give at least one program (--mcts, --react, --chat are counts >= 0)")
    if a.url is None and a.model is not None and not os.path.exists(a.model):
        ap.error(f"--model {a.model!r}: no such file or directory (a HF model directory or a .gguf file)")
    if a.keep and (a.url or a.in_process):
        ap.error(f"--keep keeps the server the demo starts; with {'--url' if a.url else '--in-process'} it starts none")
    if a.url is not None:
        problem = _server_problem(a.url, a.api_key)
        if problem is not None:
            ap.error(f"--url {a.url!r}: {problem}")
    console = Console()
    if not console.is_terminal:
        console = Console(width=150)  # a log or a pipe: room for every column
    if a.in_process:
        return anyio.run(_in_process, a, console)
    if a.url:
        return anyio.run(_remote, a, a.url, console)
    with server(a.model, a.policy) as served:
        code = anyio.run(_remote, a, served.url, console)
        if a.keep:
            served.wait_for_ctrl_c()
        return code


def _server_problem(url: str, api_key: str | None) -> str | None:
    """Why `url` is not an agentrt server this key may use (None: it is): checked before any program starts."""
    if not url.startswith(("http://", "https://")):
        return "not an http(s) URL"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{url.rstrip('/')}/v1/programs", params={"limit": 1}, headers=headers, timeout=10.0)
    except httpx.HTTPError as e:
        return f"no server answers there ({type(e).__name__}: {e})"
    if r.status_code == 401:
        return "the server wants an API key: give --api-key (or $AGENTRT_API_KEY)"
    if r.status_code != 200:
        return f"GET /v1/programs answered {r.status_code}: not an agentrt server?"
    return None
