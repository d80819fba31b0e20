"""agentrt replicas on Ray Serve, behind one HTTP front and a program-aware router.

    app = build_app(ServerConfig(model=...), replicas=2, router="program")
    serve.run(app, route_prefix="/")          # what `agentrt serve --replicas 2` does

Three deployments:

- `AgentrtReplica` (N replicas): each owns one engine and runtime, the very app `agentrt serve` runs
  (`agentrt.server.create_app`), entered once and called in-process for every request it is sent:
  the same endpoints, schemas and errors.
- `AgentrtFront` (the HTTP ingress): reads each request once, finds its program (the `X-Program-Id`
  header, the body's `program_id`, a Responses chain's `previous_response_id`, or the program in a
  `/v1/programs/{id}` path) and hands it to a replica through a deployment handle whose router is
  chosen by name: "program" (`ProgramAffinityRouter`: agentrt.scale.router's rule), or Ray's own
  as Ray ships them: "pow2" (power of two choices, Ray's default), "round-robin", "prefix" (Ray's
  `PrefixCacheAffinityRouter`).
- `AgentrtDirectory` (one replica, no CPU): the program directory (agentrt.scale.directory) every
  replica syncs with (agentrt.scale.peers), so a program is one record across replicas: its attained
  service (PLAS orders by the global figure), the program endpoints, DELETE, and /metrics labelled
  by replica.

The router runs in the front's process, so a program's home is known to the one front; a replica
that dies re-homes its programs (`on_replica_actor_died`). A call whose replica dies fails with a
503 naming the cause (or an SSE error event once streaming began), never a hang. Only this module
imports Ray: `agentrt serve` without `--replicas` never loads it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from agentrt.scale.directory import ProgramDirectory
from agentrt.scale.router import ProgramHomes, RouterConfig

log = logging.getLogger("agentrt.scale")

ROUTERS = {
    "program": "agentrt.scale.ray_app.ProgramAffinityRouter",
    "pow2": "ray.serve._private.request_router.pow_2_router.PowerOfTwoChoicesRequestRouter",
    "round-robin": "ray.serve.experimental.round_robin_router.RoundRobinRouter",
    # Ray's PrefixCacheAffinityRouter (what ray.serve.llm.request_router re-exports; that module needs
    # ray[llm]'s pyarrow, this one does not)
    "prefix": "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter",
}
_PROGRAM_PATH = re.compile(r"^/v1/programs/([^/]+)")
_PROGRAM_END = re.compile(r"^/v1/programs/[^/]+/?$")  # DELETE here ends the program
MAX_CHAINS = 100_000  # Responses ids (and programs) the front remembers the program (the replica) of


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


class ProgramAffinityRouter(FIFOMixin, RequestRouter):
    """A Ray Serve request router over agentrt.scale.router.route: a program's calls go to the replica it
    lives on unless that one is overloaded (the guard) or gone; calls without a program to the least
    loaded. Kwargs (`request_router_kwargs`): RouterConfig's fields."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.router_config = RouterConfig(**kwargs)
        self.homes = ProgramHomes()
        self.decisions: collections.Counter[str] = collections.Counter()
        self.sent: collections.OrderedDict[str, str] = collections.OrderedDict()  # internal request id -> its
        # program, from the call's send to its end (bounded: a lost completion cannot grow it)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        kw = pending_request.kwargs if pending_request is not None else {}
        pid, tokens = kw.get("program_id"), kw.get("prompt_tokens", 0)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        loads = {rid: cache.get(r.replica_id) or 0 for rid, r in by_id.items()}
        key = pending_request.metadata.request_id if pending_request is not None else ""
        d = self.homes.route(pid, tokens, loads, self.router_config, key=pid or key, now=time.monotonic(),
                             hint=kw.get("home_hint"))  # hint: a program started where the front saw it answer
        if kw.get("program_ends"):  # DELETE /v1/programs/{id}: it ends everywhere, its home is forgotten
            self.homes.forget(pid)
        self.decisions[d.reason] += 1
        return [[by_id[i] for i in rank] for rank in d.ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        pid = pending_request.kwargs.get("program_id")
        if pid is None:
            return
        self.sent[pending_request.metadata.internal_request_id] = pid
        while len(self.sent) > MAX_CHAINS:
            self.sent.popitem(last=False)
        self.homes.call_started(pid, time.monotonic())

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        pid = self.sent.pop(internal_request_id, None)
        if pid is not None:
            self.homes.call_done(pid, time.monotonic())

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        moved = self.homes.replica_gone(replica_id.unique_id)
        log.warning("agentrt replica %s died: %d programs re-home on their next call", replica_id.unique_id, moved)


class AgentrtDirectory(ProgramDirectory):
    """The program directory (agentrt.scale.directory) as a one-replica Serve deployment."""


class DirectoryHandle:
    """A Serve handle to AgentrtDirectory with ProgramDirectory's methods as coroutines (for ReplicaPeers)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.handle, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await method.remote(*args, **kwargs)

        return call


class AgentrtReplica:
    """One engine and runtime: the app `agentrt serve` runs, entered once, called per request; its program
    records and /metrics joined to the other replicas' through the directory (agentrt.scale.peers)."""

    async def __init__(self, config: Any, torch_threads: int | None = None, directory: Any = None) -> None:
        if torch_threads:
            import torch

            torch.set_num_threads(torch_threads)
        from agentrt.server import create_app

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.app = create_app(config)
        started, self._stop = asyncio.Event(), asyncio.Event()

        async def hold() -> None:  # the app's lifespan, entered and left in this one task
            async with self.app.router.lifespan_context(self.app):
                started.set()
                await self._stop.wait()

        self._lifespan = asyncio.create_task(hold())
        waiting = asyncio.create_task(started.wait())
        await asyncio.wait({waiting, self._lifespan}, return_when=asyncio.FIRST_COMPLETED)
        if not started.is_set():  # the engine failed to start: say why
            waiting.cancel()
            self._lifespan.result()
            raise RuntimeError("the agentrt app's lifespan ended before it started")
        self._sync = None
        if directory is not None:
            from agentrt.scale.peers import ReplicaPeers
            from agentrt.server.app import metrics_text

            st = self.app.state.server
            st.peers = ReplicaPeers(st, self.replica_id, DirectoryHandle(directory),
                                    render_metrics=lambda: metrics_text(st))
            self._sync = asyncio.create_task(st.peers.run())

    async def handle(self, req: Forwarded, program_id: str | None = None, prompt_tokens: int = 0,
                     home_hint: str | None = None, program_ends: bool = False) -> Any:
        """Run the request through the app: yields (status, headers) first, then the body's chunks.
        `program_id`, `prompt_tokens`, `home_hint`, `program_ends` are for the router; the app reads the request
        itself."""
        sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        gone = asyncio.Event()
        first = [True]

        async def receive() -> dict[str, Any]:
            if first[0]:
                first[0] = False
                return {"type": "http.request", "body": req.body, "more_body": False}
            await gone.wait()  # the front (or its client) went away
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await sent.put(message)

        headers = [*req.headers, (b"x-agentrt-replica", self.replica_id.encode())]
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": req.method,
                 "scheme": "http", "path": req.path, "raw_path": req.path.encode(), "query_string": req.query,
                 "root_path": "", "headers": headers, "client": ("127.0.0.1", 0), "server": ("agentrt", 80)}
        task = asyncio.create_task(self.app(scope, receive, send))
        try:
            while True:
                getter = asyncio.create_task(sent.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:  # the app returned without sending more
                    getter.cancel()
                    if task.exception() is not None:
                        raise task.exception()
                    return
                message = getter.result()
                if message["type"] == "http.response.start":
                    yield (message["status"], [*message.get("headers", []),
                                               (b"x-agentrt-replica", self.replica_id.encode())])
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        return
        finally:
            gone.set()
            if not task.done():
                try:
                    await asyncio.wait_for(task, timeout=5)
                except (asyncio.TimeoutError, Exception):
                    task.cancel()

    async def __del__(self) -> None:
        if self._sync is not None:
            self._sync.cancel()
        self._stop.set()  # the runtime drains, the engine stops, the records close
        await self._lifespan


class AgentrtFront:
    """The HTTP ingress: finds each request's program and hands it to a replica (see the module docs)."""

    def __init__(self, replicas: Any) -> None:
        self.replicas = replicas.options(stream=True)
        self.chains = ProgramHomes(MAX_CHAINS)  # a bounded LRU map too: Responses id -> the program it continued
        self.seen = ProgramHomes(MAX_CHAINS)  # program -> the replica that answered for it

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
        started = False
        try:
            stream = self.replicas.handle.remote(req, program_id=pid, prompt_tokens=len(body) // 4,
                                                 home_hint=self.seen.get(pid), program_ends=ends)
            async for item in stream:
                if not started:
                    status, out_headers = item
                    self.learn(out_headers)
                    await send({"type": "http.response.start", "status": status, "headers": out_headers})
                    started = True
                else:
                    await send({"type": "http.response.body", "body": item, "more_body": True})
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the replica died or failed: this call only
            cause = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            error = {"error": {"message": f"the agentrt replica serving this call failed ({cause[:300]})",
                               "type": "service_unavailable", "param": None, "code": "replica_failed"}}
            if not started:
                payload = json.dumps(error).encode()
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")]})
                await send({"type": "http.response.body", "body": payload, "more_body": False})
                return
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(error).encode() + b"\n\n",
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def build_app(config: Any, replicas: int = 2, router: str = "program", *, num_cpus: float = 1.0,
              torch_threads: int | None = None, router_kwargs: dict[str, Any] | None = None) -> Any:
    """The Ray Serve application: `replicas` AgentrtReplica deployments (`num_cpus` logical CPUs each,
    `torch_threads` torch threads) behind one AgentrtFront, routed by `router` (a name of ROUTERS)."""
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; expected one of {', '.join(ROUTERS)}")
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
    if router_kwargs and router != "program":
        raise ValueError("router_kwargs are RouterConfig's fields: only for router 'program'")
    if router_kwargs:
        RouterConfig(**router_kwargs)  # a bad value fails here, naming the field
    replica = serve.deployment(
        AgentrtReplica, name="agentrt-replica", num_replicas=replicas, max_ongoing_requests=1000,
        ray_actor_options={"num_cpus": num_cpus},
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[router],
                                                  request_router_kwargs=router_kwargs or {}),
    )
    directory = serve.deployment(AgentrtDirectory, name="agentrt-directory", num_replicas=1,
                                 max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
    front = serve.deployment(serve.ingress()(AgentrtFront), name="agentrt-front", num_replicas=1,
                             max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
    return front.bind(replica.bind(config, torch_threads, directory.bind()))


# A small machine under load starts Ray Serve's HTTP proxy slower than Ray's 5 s ready check allows, which
# then kills it and fails the start: give a local instance more time (a value set in the environment wins).
SLOW_START_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}


def init_local_ray(num_cpus: int, **kwargs: Any) -> None:
    """A local Ray instance for agentrt: `num_cpus` logical CPUs, no dashboard, Serve's start-up checks
    relaxed (SLOW_START_ENV); the CLI, the benchmark and the tests start theirs with it."""
    import os

    import ray

    for key, value in SLOW_START_ENV.items():
        os.environ.setdefault(key, value)
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, **kwargs)


def serve_replicas(config: Any, host: str, port: int, replicas: int, router: str = "program",
                   ray_address: str | None = None) -> int:
    """`agentrt serve --replicas N`: a local Ray instance (or the cluster at `ray_address`) with logical
    CPUs sized so N replicas fit, one replica per logical CPU with this machine's cores shared out as
    torch threads, the app on `host:port`, until SIGINT / SIGTERM."""
    import os
    import signal
    import sys
    import threading

    import ray

    cores = os.cpu_count() or 1
    app = build_app(config, replicas, router, num_cpus=1, torch_threads=max(1, cores // replicas))
    if ray_address:
        ray.init(address=ray_address, log_to_driver=False)
    else:
        init_local_ray(max(replicas, cores))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        try:
            serve.start(http_options={"host": host, "port": port})
            serve.run(app, name="agentrt", route_prefix="/")
        except Exception as e:  # Ray's own failure (a busy port, a proxy or replica that did not start): one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ValueError(f"Ray Serve did not start the app on {host}:{port} ({type(e).__name__}: {first}); "
                             "its logs are under /tmp/ray/session_latest/logs/serve") from None
        print(f"agentrt: serving {replicas} replicas of {config.model_id()} on http://{host}:{port} "
              f"(router {router}, Ray {ray.__version__})", file=sys.stderr, flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def app_builder(args: dict[str, str]) -> Any:
    """For `serve run` on a real cluster (Ray's application-builder convention; values arrive as strings):

        serve run agentrt.scale.ray_app:app_builder model=/models/Qwen2.5-1.5B-Instruct replicas=8 router=program

    Keys: model, replicas (default 2), router (default program), num_cpus (per replica, default 1),
    torch_threads, db (a database every replica shares, e.g. PostgreSQL), served_model_name, policy."""
    from agentrt.server import ServerConfig

    known = {"model", "replicas", "router", "num_cpus", "torch_threads", "db", "served_model_name", "policy"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown argument {unknown[0]!r} for agentrt's app builder; known: {', '.join(sorted(known))}")
    config = ServerConfig(**{k: args[k] for k in ("model", "db", "served_model_name", "policy") if k in args})
    threads = args.get("torch_threads")
    return build_app(config, int(args.get("replicas", 2)), args.get("router", "program"),
                     num_cpus=float(args.get("num_cpus", 1)), torch_threads=int(threads) if threads else None)
