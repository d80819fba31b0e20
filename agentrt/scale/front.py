"""The HTTP front of `agentrt serve --replicas N` (`AgentrtFront`, the Ray Serve ingress that ray_app
deploys; no Ray import here): reads each request once, finds its program and hands the request to a
replica through a deployment handle whose router decides where it runs.

A request's program: the `X-Program-Id` header, the body's `program_id`, a Responses chain's
`previous_response_id` (the front remembers which program each response id continued, from the reply's
`X-Response-Id`), or the program in a `/v1/programs/{id}` path.

On SIGTERM the process that serves the app (ray_app.Drain) calls `drain()` until it answers 0:
from the first call on, new requests get the 503 `draining` one server answers while it drains, and the
calls in flight run to their end. Past the drain's timeout `cut()` ends those still running: each gets
the 503 (or, once its stream began, an SSE error event and the stream's end) and its replica aborts it.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

from agentrt.scale.router import ProgramHomes

_PROGRAM_PATH = re.compile(r"^/v1/programs/([^/]+)")
_PROGRAM_END = re.compile(r"^/v1/programs/[^/]+/?$")  # DELETE here ends the program
MAX_CHAINS = 100_000  # Responses ids (and programs) the front remembers the program (the replica) of
DRAINING = {"error": {"message": "the server is shutting down", "type": "service_unavailable", "param": None,
                      "code": "draining"}}  # as one server's 503 while it drains (agentrt.server.calls)
CUT = {"error": {"message": "the server shut down before this call ended (its drain timeout passed)",
                 "type": "service_unavailable", "param": None, "code": "draining"}}


@dataclass(slots=True)
class Forwarded:
    """One HTTP request as the front hands it to a replica. `messages`: its chat messages or prompt text
    ("" for other requests), the attribute Ray's prefix-affinity router reads."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    messages: Any = ""


class AgentrtFront:
    """The HTTP ingress (see the module docs). `replicas`: a deployment handle to the replicas."""

    def __init__(self, replicas: Any) -> None:
        self.replicas = replicas.options(stream=True)
        self.chains = ProgramHomes(MAX_CHAINS)  # a bounded LRU map too: Responses id -> the program it continued
        self.seen = ProgramHomes(MAX_CHAINS)  # program -> the replica that answered for it
        self.draining = False  # set by drain(): new requests get a 503
        self.cutting = False  # set by cut(): the requests in flight end now
        self.in_flight: set[asyncio.Task] = set()  # HTTP requests being answered, each forwarded in its task

    def drain(self) -> int:
        """Refuse new requests from now on; answer how many are still in flight."""
        self.draining = True
        return len(self.in_flight)

    def cut(self) -> int:
        """End the requests still in flight (after drain()); answer how many there were."""
        self.cutting = True
        for task in self.in_flight:
            task.cancel()
        return len(self.in_flight)

    def calls(self) -> int:
        """How many requests are in flight."""
        return len(self.in_flight)

    def __serve_build_asgi_app__(self) -> Any:
        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:  # a plain function: uvicorn sees ASGI 3
            await self.asgi(scope, receive, send)

        return app

    def program_of(self, headers: dict[bytes, bytes], path: str, body: Any) -> str | None:
        pid = headers.get(b"x-program-id")
        if pid:
            return pid.decode("latin-1")
        m = _PROGRAM_PATH.match(path)
        if m:
            return m.group(1)
        if isinstance(body, dict):
            if isinstance(body.get("program_id"), str):
                return body["program_id"]
            prev = body.get("previous_response_id")
            if isinstance(prev, str):
                return self.chains.get(prev)
        return None

    def learn(self, headers: list[tuple[bytes, bytes]]) -> None:
        """From a reply's headers: which replica answered for its program (a program a call started, as a
        new Responses chain's, is placed there) and which program a Responses id continues."""
        h = dict(headers)
        rid, pid, replica = h.get(b"x-response-id"), h.get(b"x-program-id"), h.get(b"x-agentrt-replica")
        if pid and replica:
            self.seen.set(pid.decode("latin-1"), replica.decode("latin-1"))
        if rid and pid:
            self.chains.set(rid.decode("latin-1"), pid.decode("latin-1"))

    async def asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        if self.draining:
            body = {"status": "draining"} if scope["path"] == "/health" else DRAINING  # /health as one server's
            await _send_json(send, 503, body, [(b"retry-after", b"5"), (b"connection", b"close")])
            return
        started = [False]  # whether the response began
        task = asyncio.ensure_future(self.forward(scope, receive, send, started))
        self.in_flight.add(task)
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not self.cutting or (current is not None and current.cancelling()):  # not cut(): Serve cancels it
                raise
            if started[0]:
                await send({"type": "http.response.body", "body": b"data: " + json.dumps(CUT).encode() + b"\n\n",
                            "more_body": False})
            else:
                await _send_json(send, 503, CUT, [(b"connection", b"close")])
        finally:
            self.in_flight.discard(task)

    async def forward(self, scope: dict[str, Any], receive: Any, send: Any, started: list[bool]) -> None:
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        parsed: Any = None
        if body[:1] == b"{":
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None  # the replica answers the 400
        headers = list(scope.get("headers", []))
        text: Any = ""
        if isinstance(parsed, dict):
            text = parsed.get("messages") or parsed.get("prompt") or parsed.get("input") or ""
            if isinstance(text, list) and text and all(isinstance(t, int) for t in text):
                text = " ".join(map(str, text))  # token ids: a prefix tree over text still sees shared prefixes
        req = Forwarded(scope["method"], scope["path"], scope.get("query_string", b""), headers, body, text)
        pid = self.program_of(dict(headers), scope["path"], parsed)
        ends = scope["method"] == "DELETE" and _PROGRAM_END.match(scope["path"]) is not None
        stream = None
        try:
            stream = self.replicas.handle.remote(req, program_id=pid, prompt_tokens=len(body) // 4,
                                                 home_hint=self.seen.get(pid), program_ends=ends)
            async for item in stream:
                if not started[0]:
                    status, out_headers = item
                    self.learn(out_headers)
                    started[0] = True
                    await send({"type": "http.response.start", "status": status, "headers": out_headers})
                else:
                    await send({"type": "http.response.body", "body": item, "more_body": True})
        except asyncio.CancelledError:  # cut(), or Serve's cancel when the client left: the replica aborts the
            if stream is not None:  # call (a stream's consumer going away alone leaves it running)
                stream.cancel()
            raise
        except Exception as e:  # the replica died or failed: this call only
            cause = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            error = {"error": {"message": f"the agentrt replica serving this call failed ({cause[:300]})",
                               "type": "service_unavailable", "param": None, "code": "replica_failed"}}
            if not started[0]:
                await _send_json(send, 503, error, [(b"retry-after", b"1")])
                return
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(error).encode() + b"\n\n",
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send_json(send: Any, status: int, body: Any, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *headers]})
    await send({"type": "http.response.body", "body": json.dumps(body).encode(), "more_body": False})
