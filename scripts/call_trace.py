"""Trace the project files one HTTP chat call crosses (issue 34's measure of the chat path).

    .venv/bin/python scripts/call_trace.py [--tokenizer DIR] [--max-tokens 8] [--threads] [--resumes]
                                           [--engine-as-one] [--show] [--hops]

Runs ONE non-streaming POST /v1/chat/completions through the ASGI app in-process (starlette's
TestClient, the lifespan entered, a tiny random Llama with the real tokenizer as the tests build it)
and records every Python call event (sys.setprofile, threading.setprofile) from the route handler's
entry to its return (the response rendered). Counted: the request's own path, i.e. the handler's task
and the tasks it starts, on the event loop thread; with --threads also the worker threads it hands
work to (anyio.to_thread carries the request's context). A call event is a frame's first entry: a
suspended coroutine resumed (once per token streamed back) is not a new call unless --resumes. The engine's step thread and other tasks on
the loop are not counted. Only files under agentrt/, engine/ and kernels/ are kept.

Printed: distinct files crossed; file-to-file hops (call events whose callee file differs from the
file of the nearest project frame that called it; a coroutine resumed by the event loop has none);
returns to a file already left (positions in the sequence of files entered, runs collapsed, whose
file was visited before). With --engine-as-one, engine/ and kernels/ count as one file, "engine/*": the
path the chat call takes above the engine's client, the engine's own internals left out.
"""

from __future__ import annotations

import argparse
import contextvars
import dis
import os
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("AGENTRT_DTYPE", "float32")

ROOT = Path.cwd().resolve()
FLOORS = ("agentrt/", "engine/", "kernels/")
HANDLER = ("agentrt/server/openai_routes.py", "chat_completions")
_in_request: contextvars.ContextVar[bool] = contextvars.ContextVar("call_trace_in_request", default=False)


@dataclass
class Trace:
    """What the profiler saw of the request."""

    threads: bool  # count worker threads carrying the request's context too
    resumes: bool  # count a suspended coroutine's or generator's resumption as a call too
    engine_as_one: bool = False  # engine/ and kernels/ files count as one, "engine/*"
    armed: bool = False  # the traced request is the next one the handler takes
    loop_thread: int | None = None  # the thread the handler ran on
    active: bool = False  # between the handler's entry and its return
    files: list[str] = field(default_factory=list)  # callee file per counted call event
    hops: list[str] = field(default_factory=list)  # per call event whose callee file differs from its caller's
    _entered: dict[int, FrameType] = field(default_factory=dict)  # frames called once (held: ids stay unique)
    _rel: dict[str, str | None] = field(default_factory=dict)

    def rel(self, filename: str) -> str | None:
        """A project file's path from the repository root; None for any other file."""
        if filename not in self._rel:
            try:
                p = Path(filename).resolve().relative_to(ROOT).as_posix()
            except ValueError:
                p = None
            if p is not None and self.engine_as_one and p.startswith(("engine/", "kernels/")):
                p = "engine/*"
            self._rel[filename] = p if p is not None and p.startswith(FLOORS) else None
        return self._rel[filename]

    def caller_file(self, frame: FrameType) -> str | None:
        f = frame.f_back
        while f is not None:
            p = self.rel(f.f_code.co_filename)
            if p is not None:
                return p
            f = f.f_back
        return None

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        path = self.rel(frame.f_code.co_filename)
        if path is None:
            return
        code = frame.f_code
        is_handler = path == HANDLER[0] and code.co_name == HANDLER[1]
        if event == "call" and is_handler and self.armed and not self.active:
            self.active, self.armed, self.loop_thread = True, False, threading.get_ident()
            _in_request.set(True)  # the handler task's context: the tasks it starts copy it
        elif event == "return" and is_handler and self.active and _in_request.get() and _done(frame):
            self.active = False
        if event != "call" or not self.active or not _in_request.get():
            return
        if threading.get_ident() != self.loop_thread and not self.threads:
            return
        if id(frame) in self._entered and not self.resumes:
            return
        self._entered[id(frame)] = frame
        caller = self.caller_file(frame)
        if caller is not None and caller != path:
            self.hops.append(f"{caller} -> {path}:{code.co_name}")
        self.files.append(path)


def _done(frame: FrameType) -> bool:
    """The handler's coroutine returns for good, not suspended at an await (its last instruction a return)."""
    at = next((i for i in dis.get_instructions(frame.f_code) if i.offset == frame.f_lasti), None)
    return at is not None and at.opname.startswith("RETURN")


def returns_to_left(files: list[str]) -> int:
    """Times the sequence of files (runs collapsed) enters a file it visited before."""
    seen: set[str] = set()
    count, prev = 0, None
    for f in files:
        if f == prev:
            continue
        if f in seen:
            count += 1
        seen.add(f)
        prev = f
    return count


def collapsed(files: list[str]) -> list[str]:
    return [f for i, f in enumerate(files) if i == 0 or files[i - 1] != f]


def tiny_model(tokenizer: str | None) -> Path:
    from agentrt.engine.testing import make_tiny_model

    return make_tiny_model(Path(tempfile.mkdtemp(prefix="call-trace-")) / "tiny", tokenizer_from=tokenizer)


def make_app(model: Path) -> Any:
    from agentrt.server import ServerConfig, create_app

    return create_app(ServerConfig(model=str(model), engine={"num_blocks": 256, "max_num_seqs": 16}, db="none"))


def run(tokenizer: str | None, max_tokens: int, threads: bool, resumes: bool,
        engine_as_one: bool = False) -> tuple[Trace, int]:
    from starlette.testclient import TestClient

    body = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello."}]}
    trace = Trace(threads, resumes, engine_as_one)
    app = make_app(tiny_model(tokenizer))
    threading.setprofile(trace.profile)  # before the loop's and the workers' threads start
    try:
        with TestClient(app) as client:
            warm = client.post("/v1/chat/completions", json=body)  # first-use caches filled before the trace
            assert warm.status_code == 200, warm.text
            trace.armed = True
            r = client.post("/v1/chat/completions", json=body)
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    assert r.status_code == 200, r.text
    return trace, r.json()["usage"]["completion_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=os.environ.get("AGENTRT_TEST_TOKENIZER"),
                    help="a model directory whose tokenizer the tiny model takes (default: the default model's)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", action="store_true", help="count worker threads the request hands work to")
    ap.add_argument("--resumes", action="store_true",
                    help="count each resumption of a suspended coroutine as a call event (per token generated)")
    ap.add_argument("--engine-as-one", action="store_true",
                    help="count engine/ and kernels/ as one file: the path above the engine's client")
    ap.add_argument("--show", action="store_true", help="print the sequence of files (runs collapsed)")
    ap.add_argument("--hops", action="store_true", help="print each hop: caller file -> callee file:function")
    args = ap.parse_args()
    trace, tokens = run(args.tokenizer, args.max_tokens, args.threads, args.resumes, args.engine_as_one)
    if args.show:
        print("\n".join(collapsed(trace.files)))
    if args.hops:
        print("\n".join(trace.hops))
    where = "event loop + worker threads" if args.threads else "event loop thread"
    where += ", coroutine resumptions included" if args.resumes else ", first entries of frames only"
    where += ", engine/ and kernels/ as one file" if args.engine_as_one else ""
    print(f"one /v1/chat/completions call ({tokens} tokens generated), counted on the {where}:")
    print(f"  distinct files crossed:          {len(set(trace.files))}")
    print(f"  file-to-file hops:               {len(trace.hops)}")
    print(f"  returns to a file already left:  {returns_to_left(trace.files)}")


if __name__ == "__main__":
    main()
