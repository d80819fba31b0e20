"""A real server on loopback for tests: uvicorn in a thread of its own, on a free port."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import uvicorn
from starlette.applications import Starlette

from agentrt.server import ServerConfig, create_app
from agentrt.server.state import ServerState


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range (and above Ray's worker ports, 10002-19999).

    A port the kernel handed out for `bind(0)` is free only until someone else binds it, and Ray's own
    processes take many ephemeral ports while they start: a server told to listen on one later could find
    it taken ("Address already in use"). Ports outside that range are handed out by no one."""
    rng = random.Random()
    low = _ephemeral_low()
    for _ in range(200):
        port = rng.randrange(20000, max(20001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a machine whose range leaves no room: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    app: Starlette
    server: uvicorn.Server

    @property
    def state(self) -> ServerState:
        return self.app.state.server

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Until the engine holds no request (aborts land on the server's loop asynchronously)."""
        core = self.state.runtime._engine().core
        deadline = time.monotonic() + timeout_s
        while core.scheduler.has_work() or core.requests:
            if time.monotonic() > deadline:
                raise AssertionError(f"engine still busy: {list(core.requests)}")
            time.sleep(0.02)


def tiny_config(model_path, **kw) -> ServerConfig:
    engine = {"num_blocks": 256, "max_num_seqs": 16, **kw.pop("engine", {})}
    return ServerConfig(model=str(model_path), engine=engine, db=kw.pop("db", "none"), **kw)


@contextlib.contextmanager
def live_server(config: ServerConfig) -> Iterator[LiveServer]:
    app = create_app(config)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=config.drain_timeout_s))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  (not the main thread)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", app, server)
    finally:
        server.should_exit = True
        thread.join(60)


def bad_request(http, path: str, **body) -> dict:
    """POST `body` (for the model "tiny") to `path`, expecting a 400; its OpenAI-style error object."""
    r = http.post(path, json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    return r.json()["error"]


def wait_healthy(proc, url: str, log, timeout_s: float = 120) -> None:
    """Until `agentrt serve` in the child `proc` (its output in the file `log`) answers /health with 200."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"serve exited with {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, "serve did not become healthy"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)


class Stream(threading.Thread):
    """One streaming chat call of `num_tokens` tokens (EOS ignored), read to its end in a thread of its own;
    `started` is set once a few tokens arrived (or it failed: `error`)."""

    def __init__(self, url: str, program_id: str, num_tokens: int, timeout_s: float = 60) -> None:
        super().__init__(daemon=True)
        self.url, self.program_id, self.num_tokens, self.timeout_s = url, program_id, num_tokens, timeout_s
        self.started = threading.Event()
        self.events: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": self.num_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=self.timeout_s,
                              headers={"X-Program-Id": self.program_id}) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        if len(self.events) > 5:
                            self.started.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.started.set()

    def chunks(self) -> list[dict]:
        return [json.loads(e) for e in self.events[:-1]]
