"""agentrt replicas on Ray Serve, behind one HTTP front and a program-aware router.

    app = build_app(ServerConfig(model=...), replicas=2, router="program")
    serve.run(app, route_prefix="/")          # what `agentrt serve --replicas 2` does

Three deployments:

- `AgentrtReplica` (N replicas): each owns one engine and runtime, the very app `agentrt serve` runs
  (`agentrt.server.create_app`), entered once and called in-process for every request it is sent:
  the same endpoints, schemas and errors.
- `AgentrtFront` (the HTTP ingress, agentrt.scale.front): reads each request once, finds its program
  and hands it to a replica through a deployment handle whose router is chosen by name: "program"
  (`ProgramAffinityRouter`: agentrt.scale.router's rule), or Ray's own as Ray ships them: "pow2"
  (power of two choices, Ray's default), "round-robin", "prefix" (Ray's `PrefixCacheAffinityRouter`).
- `AgentrtDirectory` (one replica, no CPU): the program directory (agentrt.scale.directory) every
  replica syncs with (agentrt.scale.peers), so a program is one record across replicas: its attained
  service (PLAS orders by the global figure), the program endpoints, DELETE, and /metrics labelled
  by replica.

The router runs in the front's process, so a program's home is known to the one front; a replica
that dies re-homes its programs (`on_replica_actor_died`). A call whose replica dies fails with a
503 naming the cause (or an SSE error event once streaming began), never a hang. Only this module
imports Ray: `agentrt serve` without `--replicas` never loads it.

`serve_replicas` is `agentrt serve --replicas N`'s process: a local Ray instance whose every listener is
on a loopback `--host` (`init_local_ray`), and on SIGTERM a drain before Serve shuts down (`Drain`): Serve's
own shutdown stops its HTTP proxies at once, cutting the calls they still stream.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from agentrt.scale.directory import ProgramDirectory
from agentrt.scale.front import MAX_CHAINS, AgentrtFront, Forwarded
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


def _replica_grpc_on_loopback() -> None:
    """Ray Serve 2.60 opens a gRPC server in every replica, for handles that send requests by gRPC (agentrt's
    do not), on "[::]:0": every interface, whatever the node's address. On a node whose address is loopback
    (init_local_ray on a loopback host) open it there instead. Each deployment's constructor calls this:
    Serve opens that server after the constructor returns."""
    import ipaddress

    import ray
    from ray.serve._private import replica

    ip = ray.util.get_node_ip_address()
    if not _is_loopback(ip) or getattr(replica.add_port_to_grpc_server, "agentrt_ip", None) == ip:
        return
    add_port = replica.add_port_to_grpc_server
    bound = f"[{ip}]:0" if ipaddress.ip_address(ip).version == 6 else f"{ip}:0"

    def on_node_ip(server: Any, address: str) -> int:
        return add_port(server, bound if address == "[::]:0" else address)

    on_node_ip.agentrt_ip = ip  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = on_node_ip


class AgentrtDirectory(ProgramDirectory):
    """The program directory (agentrt.scale.directory) as a one-replica Serve deployment."""

    def __init__(self) -> None:
        _replica_grpc_on_loopback()
        super().__init__()


class RayFront(AgentrtFront):
    """AgentrtFront as a Serve deployment."""

    def __init__(self, replicas: Any) -> None:
        _replica_grpc_on_loopback()
        super().__init__(replicas)


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
        _replica_grpc_on_loopback()
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
        st = self.app.state.server
        st.recorder.replica = self.replica_id  # its calls' records (timelines) and spans name it
        if st.runtime.tracer is not None:
            st.runtime.tracer.replica = self.replica_id
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
    stop = {"graceful_shutdown_wait_loop_s": 0.2}  # Serve stops a replica once it has nothing in flight, checked
    # this often (2 s by default): after the drain (`Drain`) nothing is
    replica = serve.deployment(
        AgentrtReplica, name="agentrt-replica", num_replicas=replicas, max_ongoing_requests=1000,
        ray_actor_options={"num_cpus": num_cpus}, **stop,
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[router],
                                                  request_router_kwargs=router_kwargs or {}),
    )
    directory = serve.deployment(AgentrtDirectory, name="agentrt-directory", num_replicas=1,
                                 max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0}, **stop)
    front = serve.deployment(serve.ingress()(RayFront), name="agentrt-front", num_replicas=1,
                             max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0}, **stop)
    return front.bind(replica.bind(config, torch_threads, directory.bind()))


# A small machine under load starts Ray Serve's HTTP proxy slower than Ray's 5 s ready check allows, which
# then kills it and fails the start: give a local instance more time (a value set in the environment wins).
SLOW_START_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}
# A draining proxy reports itself drained once it has nothing in flight and has drained this long (30 s by
# default, for load balancers to notice): `drain` asks as soon as the front has nothing in flight.
DRAIN_ENV = {"RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S": "0.1"}
# Ray's switch between a node on loopback (its default on macOS and Windows) and a node reachable by other
# hosts (its default on Linux): "0" puts the node's address, and so its listeners, on loopback.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
PROXY_FLUSH_S = 2.0  # after the front's last call ended, how long `drain` waits for the proxies to send it


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def init_local_ray(num_cpus: int, host: str = "127.0.0.1", **kwargs: Any) -> None:
    """A local Ray instance for agentrt: `num_cpus` logical CPUs, no dashboard, Serve's start-up checks
    relaxed (SLOW_START_ENV); the CLI, the benchmark and the tests start theirs with it.

    Its listeners follow `host`, the address the app will serve on. A loopback host puts the node on
    loopback (LOOPBACK_ENV, for the processes Ray starts and for this one): the GCS, the raylet, every
    worker's gRPC server, the dashboard and runtime-env agents and the metrics ports listen on 127.0.0.1,
    and Serve replicas' gRPC servers too (`_replica_grpc_on_loopback`). Another address becomes the node's
    address (the agents listen there), but Ray 2.60 opens its gRPC servers either on loopback or on every
    interface, so those listen on every interface (docs/serving.md). Ray's dashboard process still runs,
    with its usage-stats module only: no web UI, no port 8265."""
    import os

    import ray
    from ray._private import ray_constants

    for key, value in {**SLOW_START_ENV, **DRAIN_ENV}.items():
        os.environ.setdefault(key, value)
    if _is_loopback(host):
        os.environ[LOOPBACK_ENV] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False  # read from the environment when Ray was imported
    elif host not in ("", "0.0.0.0", "::"):
        kwargs.setdefault("_node_ip_address", host)
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, **kwargs)


class Drain:
    """SIGTERM's drain, before `serve.shutdown()` (which stops Serve's HTTP proxies at once, cutting what
    they still send). Made once the app runs, so that the handles have found the front and the proxies by
    the time the signal comes; `drain(timeout_s, give_up)` then makes the front refuse new requests (503
    `draining`) and lets the calls in flight run to their end, for at most `timeout_s` or until
    `give_up()`; the front ends those still running (`AgentrtFront.cut`: an error event, the replica
    aborts the call) and the proxies finish sending it all (Ray's proxy drain), each within PROXY_FLUSH_S.
    It answers how many calls were still in flight at the timeout (None: the front did not answer)."""

    def __init__(self, app_name: str = "agentrt") -> None:
        import ray
        from ray.serve.context import _get_global_client

        self.front = serve.get_deployment_handle("agentrt-front", app_name=app_name)
        self.front.calls.remote().result(timeout_s=60)
        try:
            self.proxies = list(ray.get(_get_global_client()._controller.get_proxies.remote(), timeout=60).values())
        except Exception as e:  # the proxies stop with Serve anyway; the front's drain is what matters
            log.warning("Serve's proxies were not found (they will not be drained): %s", e)
            self.proxies = []

    def __call__(self, timeout_s: float, give_up: Any = lambda: False) -> int | None:
        import ray

        deadline = time.monotonic() + timeout_s
        for proxy in self.proxies:
            proxy.update_draining.remote(True)
        left: int | None = None
        while True:
            try:
                left = self.front.drain.remote().result(timeout_s=max(1.0, min(5.0, deadline - time.monotonic())))
            except Exception as e:
                log.warning("draining the front failed: %s", e)
                return None
            if left == 0 or give_up() or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if left:  # past the timeout: those calls end now (an error event), rather than run on in their replica
            try:
                self.front.cut.remote().result(timeout_s=5)
                cut_deadline = time.monotonic() + PROXY_FLUSH_S
                while self.front.calls.remote().result(timeout_s=5) and time.monotonic() < cut_deadline:
                    time.sleep(0.05)
            except Exception as e:
                log.warning("ending the front's calls failed: %s", e)
        flush_deadline = time.monotonic() + PROXY_FLUSH_S
        while self.proxies and not give_up() and time.monotonic() < flush_deadline:
            try:
                drained = ray.get([p.is_drained.remote() for p in self.proxies],
                                  timeout=max(0.1, flush_deadline - time.monotonic()))
            except Exception:
                break
            if all(drained):
                break
            time.sleep(0.05)
        return left


def _cause_line(e: BaseException) -> str:
    """The line of a Ray error that says what went wrong: a RayTaskError's message is the remote traceback,
    whose first line names the actor method and whose last `SomeError: ...` line names the cause (for a
    busy port: "RuntimeError: Failed to bind to address '127.0.0.1:8000'.")."""
    import re

    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    causes = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception)(\(\w+\))?: \S", line)]
    if causes:
        return causes[-1]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def serve_replicas(config: Any, host: str, port: int, replicas: int, router: str = "program",
                   ray_address: str | None = None) -> int:
    """`agentrt serve --replicas N`: a local Ray instance (or the cluster at `ray_address`) with logical
    CPUs sized so N replicas fit, one replica per logical CPU with this machine's cores shared out as
    torch threads, the app on `host:port`, until SIGINT / SIGTERM. Then, as one server: new requests get a
    503, the calls in flight get `config.drain_timeout_s` to finish (a second signal stops waiting), Serve
    and Ray stop (each replica's records are flushed) and the exit status is 0."""
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
        init_local_ray(max(replicas, cores), host)
    signals: list[int] = []
    stop = threading.Event()
    signalled = drained = time.monotonic()

    def on_signal(signum: int, _frame: Any) -> None:
        signals.append(signum)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        try:
            serve.start(http_options={"host": host, "port": port})
            serve.run(app, name="agentrt", route_prefix="/")
            drain = Drain("agentrt")
        except Exception as e:  # Ray's own failure (a busy port, a proxy or replica that did not start): one line
            raise ValueError(f"Ray Serve did not start the app on {host}:{port} ({_cause_line(e)}); "
                             "its logs are under /tmp/ray/session_latest/logs/serve") from None
        print(f"agentrt: serving {replicas} replicas of {config.model_id()} on http://{host}:{port} "
              f"(router {router}, Ray {ray.__version__})", file=sys.stderr, flush=True)
        if not ray_address and not _is_loopback(host):
            print(f"agentrt: on --host {host}, Ray's GCS, raylet and worker gRPC servers listen on every interface "
                  "(Ray opens them on loopback or on all; see docs/serving.md)", file=sys.stderr, flush=True)
        while not stop.wait(0.1):  # a timeout: Python runs a signal handler when this thread next runs, and the
            pass  # kernel may deliver the signal to one of Ray's threads, which does not wake this one
        signalled = time.monotonic()
        print(f"agentrt: draining (up to {config.drain_timeout_s:g} s)", file=sys.stderr, flush=True)
        left = drain(config.drain_timeout_s, give_up=lambda: len(signals) > 1)
        drained = time.monotonic()
        if left:
            print(f"agentrt: {left} calls still in flight after the drain are cut", file=sys.stderr, flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    if signals:
        now = time.monotonic()
        print(f"agentrt: stopped {now - signalled:.1f} s after the signal (drain {drained - signalled:.1f} s, "
              f"Serve and Ray {now - drained:.1f} s)", file=sys.stderr, flush=True)
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
