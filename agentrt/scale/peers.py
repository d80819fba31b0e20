"""A replica's link to the program directory (`ServerState.peers`): what makes one program one record
across replicas. No Ray import: `directory` is anything with ProgramDirectory's methods as coroutines
(ray_app's `DirectoryHandle` over a Serve handle; the tests' `LocalDirectory`).

- `run()` (a task for the replica's life): every `interval_s` the programs that changed here are sent
  (`flush`) and the answer applied: each program's service on other replicas is credited to this
  engine's policy (PLAS / ATLAS order by the global figure) and a program a DELETE ended elsewhere is
  ended here. Every `metrics_interval_s` this replica's /metrics text is sent too.
- `admit(pid, owner)` before a program's first call on this replica claims the id in the directory:
  another key's running program is a 404 here as on its home, and the service it had elsewhere is
  credited before the call is queued.
- `program`, `programs`, `end`, `metrics`: the program endpoints and /metrics answer from the directory.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import anyio
import msgspec

from agentrt._errors import ProgramNotFoundError
from agentrt.scale.directory import merge_expositions
from agentrt.server.errors import APIError
from agentrt.server.program_routes import live_view

log = logging.getLogger("agentrt.scale")


class LocalDirectory:
    """A ProgramDirectory in this process behind the async interface replicas use, safe for servers on
    several threads (for tests)."""

    def __init__(self, directory: Any) -> None:
        self.directory = directory
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.directory, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                return method(*args, **kwargs)

        return call


class ReplicaPeers:
    def __init__(self, st: Any, replica_id: str, directory: Any, *, interval_s: float = 0.25,
                 metrics_interval_s: float = 1.0, render_metrics: Any = None) -> None:
        self.st = st
        self.replica_id = replica_id
        self.directory = directory
        self.interval_s = interval_s
        self.metrics_interval_s = metrics_interval_s
        self.render_metrics = render_metrics  # async () -> this replica's /metrics text
        self.epoch: str | None = None
        self.sent: dict[str, tuple[Any, ...]] = {}  # program -> what it looked like when last sent
        self.credited: dict[str, tuple[float, float]] = {}  # program -> service elsewhere last credited
        self._lock = anyio.Lock()
        self.num_syncs = 0
        self.num_failures = 0

    # --- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        last_metrics = 0.0
        while True:
            try:
                await self.flush()
                if self.render_metrics is not None and time.monotonic() - last_metrics >= self.metrics_interval_s:
                    last_metrics = time.monotonic()
                    await self.directory.metrics(self.replica_id, await self.render_metrics())
            except Exception as e:  # the directory restarting: programs keep running here, sync resumes
                self.num_failures += 1
                if self.num_failures in (1, 10) or self.num_failures % 100 == 0:
                    log.warning("agentrt replica %s: program sync failed (%d so far): %s: %s", self.replica_id,
                                self.num_failures, type(e).__name__, e)
            await anyio.sleep(self.interval_s)

    def _changed(self) -> tuple[list[dict[str, Any]], list[str]]:
        table = self.st.runtime.programs
        views, active = [], []
        for info in table:
            if info.state == "running":
                active.append(info.program_id)
            key = (info.state, info.calls_done, info.calls_waiting, info.calls_running, info.service_s)
            if self.sent.get(info.program_id) != key:
                self.sent[info.program_id] = key
                view = msgspec.to_builtins(live_view(self.st, info))
                view["owner"] = info.owner
                views.append(view)
        if len(self.sent) > len(table):  # the table dropped ended programs: so does this
            for pid in [p for p in self.sent if p not in table]:
                del self.sent[pid]
                self.credited.pop(pid, None)
        return views, active

    async def flush(self) -> None:
        """Send what changed here; credit service elsewhere; end what a DELETE ended elsewhere."""
        async with self._lock:
            views, active = self._changed()
            try:
                reply = await self.directory.sync(self.replica_id, views, active)
            except BaseException:
                for v in views:  # not delivered: send again next time
                    self.sent.pop(v["id"], None)
                raise
            self.num_syncs += 1
            if reply["epoch"] != self.epoch:  # a new directory: it has nothing of ours yet
                if self.epoch is not None:
                    self.sent.clear()
                self.epoch = reply["epoch"]
            for pid, e in reply["programs"].items():
                self._credit(pid, e["service_s"], e["critical_path_s"])
                info = self.st.runtime.programs.get(pid)
                if e["end"] and info is not None and info.state == "running":
                    with contextlib.suppress(ProgramNotFoundError):  # ended here meanwhile
                        self.st.runtime.end_program(pid)  # as a DELETE here would (its calls aborted)

    def _credit(self, pid: str, service_s: float, critical_s: float) -> None:
        if self.credited.get(pid, (0.0, 0.0)) != (service_s, critical_s):
            self.credited[pid] = (service_s, critical_s)
            self.st.runtime.credit_service(pid, service_s, critical_s)

    # --- for the routes ---------------------------------------------------------------------------
    async def admit(self, pid: str, owner: str | None) -> None:
        """Before a call of `pid` that this replica does not run yet: 404 for another key's running program;
        credit the service it had elsewhere."""
        info = self.st.runtime.programs.get(pid)
        if info is not None and info.state == "running":
            return
        try:
            found = await self.directory.claim(pid, owner)
        except Exception as e:  # the directory restarting: serve the call (this replica checks its own owners)
            log.warning("agentrt replica %s: could not claim program %r in the directory: %s: %s",
                        self.replica_id, pid, type(e).__name__, e)
            return
        if found["owner"] != owner:
            raise ProgramNotFoundError("no such program", program_id=pid)
        self._credit(pid, found["service_s"], found["critical_path_s"])

    async def _ask(self, method: str, *args: Any, flush: bool = True) -> Any:
        """A directory read for a route, after sending this replica's changes: a 503 naming the cause when
        the directory cannot answer (one replica's view would be a wrong answer, not a partial one)."""
        try:
            if flush:
                await self.flush()
            return await getattr(self.directory, method)(*args)
        except Exception as e:
            raise APIError(503, f"the program directory did not answer ({type(e).__name__}: {str(e)[:200]})",
                           "service_unavailable", None, "directory_unavailable", {"Retry-After": "1"}) from None

    async def program(self, pid: str, owner: str | None) -> dict[str, Any] | None:
        return await self._ask("program", pid, owner)

    async def programs(self, owner: str | None, state: str | None, limit: int,
                       before: tuple[float, str] | None) -> list[dict[str, Any]]:
        return await self._ask("page", owner, state, limit, before)

    async def known(self, pids: list[str]) -> set[str]:
        return set(await self._ask("known", pids, flush=False)) if pids else set()

    async def end(self, pid: str, owner: str | None) -> dict[str, Any] | None:
        return await self._ask("end", pid, owner)

    async def metrics(self, text: str) -> str:
        """Every replica's series, labelled; this replica's alone (labelled) when the directory cannot answer."""
        try:
            return await self.directory.metrics(self.replica_id, text)
        except Exception as e:
            log.warning("agentrt replica %s: /metrics without the other replicas: %s: %s", self.replica_id,
                        type(e).__name__, e)
            return merge_expositions({self.replica_id: text})
