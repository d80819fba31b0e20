"""`agentrt serve --replicas 2` as a process: every listener it starts (the front, Ray's GCS, raylet,
workers, agents) is on loopback with the default --host, and a SIGTERM drains as one server's does: new
requests get a 503, a long stream started before the signal ends with [DONE], the replicas' records are
flushed, and the process exits 0 with no Ray process left behind. The front's drain alone is tested
without Ray.

Skips, saying why, where the `ray` extra is not installed (`pip install agentrt[ray]`); CI installs it."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from agentrt.scale.front import AgentrtFront
from agentrt.server.store import Store
from tests.server.live import Stream, free_port, wait_healthy
from tests.waiting import await_until, wait_until

ROOT = Path(__file__).resolve().parents[2]
DRAIN_TIMEOUT_S = 30
NUM_TOKENS = 1500  # the stream outlasts the signal by seconds on any machine


def _listeners(procs: list[psutil.Process]) -> list[tuple[str, int, str]]:
    out = []
    for p in procs:
        try:
            out += [(c.laddr.ip, c.laddr.port, p.name()) for c in p.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN]
        except psutil.Error:  # a worker that ended meanwhile
            pass
    return out


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    return addr.is_loopback or (addr.version == 6 and addr.ipv4_mapped is not None and addr.ipv4_mapped.is_loopback)


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:  # it ended between the two questions
            pass
    return out


def _refused(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 503
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        return True


def test_replicas_listen_on_loopback_only_and_sigterm_drains(tiny_model_path, tmp_path):
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed: pip install 'agentrt[ray]'")
    port, db = free_port(), f"sqlite:///{tmp_path}/records.db"
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "agentrt.cli", "serve", "--replicas", "2", "--model", str(tiny_model_path),
           "--port", str(port), "--num-blocks", "256", "--db", db, "--drain-timeout", str(DRAIN_TIMEOUT_S)]
    log = tmp_path / "serve.log"  # a file, not a pipe: a full pipe would stall the server
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    tree: list[psutil.Process] = []
    try:
        wait_healthy(proc, url, log, timeout_s=240)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        listening = _listeners(tree)
        assert ("127.0.0.1", port, "ray::ProxyActor") in listening, listening
        names = {name for _, _, name in listening}
        assert {"gcs_server", "raylet"} <= names, names  # Ray's own servers were seen, and are checked
        assert [x for x in listening if not _loopback(x[0])] == [], listening
        assert 8265 not in {p for _, p, _ in listening}, listening  # no dashboard web UI

        stream = Stream(url, "drained", NUM_TOKENS, timeout_s=120)
        stream.start()
        assert stream.started.wait(120) and stream.error is None, stream.error
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        while not _refused(url):
            assert time.monotonic() - signalled < 10, "new requests still served after SIGTERM"
            time.sleep(0.05)
        assert stream.is_alive(), "the stream ended before the drain began: nothing was tested"
        stream.join(DRAIN_TIMEOUT_S)
        assert stream.error is None, f"{stream.error!r}\n{log.read_text()[-3000:]}"
        assert stream.events[-1] == "[DONE]", stream.events[-3:]
        chunks = [json.loads(e) for e in stream.events[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == NUM_TOKENS
        rc = proc.wait(DRAIN_TIMEOUT_S + 15)
        output = log.read_text()
        assert rc == 0, output[-3000:]
        assert time.monotonic() - signalled < DRAIN_TIMEOUT_S + 10, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
        # Ray's processes end with the driver's ray.shutdown()
        wait_until(lambda: not _alive(tree), "every Ray process to end after the driver's exit", timeout_s=15,
                   describe=lambda: (_alive(tree), output[-3000:]))
    finally:
        for p in [*tree[1:], *([psutil.Process(proc.pid)] if proc.poll() is None else [])]:
            try:
                p.kill()
            except psutil.Error:
                pass
        proc.wait()
    with Store(db) as store:  # the replica's records were flushed as it stopped
        (call,) = store.list_calls("drained")
        assert (call.finish_reason, call.num_output_tokens, call.error) == ("length", NUM_TOKENS, None)


class _Replicas:
    """A deployment handle's stand-in: each call streams (status, headers), then three body chunks, one
    whenever `step` is set."""

    def __init__(self) -> None:
        self.step = asyncio.Event()
        self.cancelled = 0

    def options(self, **_: object) -> _Replicas:
        return self

    @property
    def handle(self) -> _Replicas:
        return self

    def remote(self, *_: object, **__: object) -> _Stream:
        return _Stream(self)


class _Stream:
    def __init__(self, replicas: _Replicas) -> None:
        self.replicas = replicas
        self.items = self.chunks()

    async def chunks(self):
        yield 200, [(b"content-type", b"text/event-stream")]
        for i in range(3):
            await self.replicas.step.wait()
            self.replicas.step.clear()
            yield f"data: {i}\n\n".encode()

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self):
        return await self.items.__anext__()

    def cancel(self) -> None:  # as DeploymentResponseGenerator.cancel: the replica's call is cancelled
        self.replicas.cancelled += 1


async def _call(front: AgentrtFront, path: str = "/v1/chat/completions") -> tuple[int, bytes]:
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive() -> dict:
        return messages.pop() if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await front.asgi({"type": "http", "method": "POST", "path": path, "headers": []}, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_the_fronts_drain_refuses_new_requests_and_lets_calls_in_flight_end():
    async def main() -> None:
        replicas = _Replicas()
        front = AgentrtFront(replicas)
        call = asyncio.create_task(_call(front))
        await await_until(lambda: front.calls() == 1, "the front to take the call", interval_s=0.001)
        assert front.drain() == 1
        status, body = await _call(front)  # refused while the first one still streams
        assert status == 503 and json.loads(body)["error"]["code"] == "draining"
        status, body = await _call(front, "/health")
        assert status == 503 and json.loads(body) == {"status": "draining"}
        for i in range(3):
            replicas.step.set()
            await await_until(lambda: not replicas.step.is_set(), f"the replica to send chunk {i}", interval_s=0.001)
        assert await call == (200, b"data: 0\n\ndata: 1\n\ndata: 2\n\n")
        assert front.drain() == 0

    asyncio.run(main())


def test_past_the_drain_timeout_the_front_ends_its_calls_with_an_error_event():
    async def main() -> None:
        replicas = _Replicas()
        front = AgentrtFront(replicas)
        call = asyncio.create_task(_call(front))
        replicas.step.set()  # the first chunk is sent in the step that clears the event (the fake's send never waits)
        await await_until(lambda: not replicas.step.is_set(), "the replica to send its first chunk", interval_s=0.001)
        assert front.drain() == 1 and front.cut() == 1
        status, body = await call
        first, error = body.split(b"\n\n", 1)
        assert status == 200 and first == b"data: 0"  # the stream so far, then why it ends
        assert json.loads(error.removeprefix(b"data: "))["error"]["code"] == "draining"
        assert front.calls() == 0 and replicas.cancelled == 1  # its replica aborts the call

    asyncio.run(main())
