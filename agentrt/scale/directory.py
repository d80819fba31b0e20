"""The program directory: one record per program across all replicas (no Ray import; ray_app runs it as a
one-replica Serve deployment, the tests as a plain object).

Why a directory and not state carried with each call: a program's record is read where no call of it
runs (`GET /v1/programs/{id}` on any replica, `/v1/programs`, DELETE, /metrics), a re-homed program
must find its service on a replica it never ran on, and a DELETE must reach replicas that run its
calls now. State carried in calls would be as fresh as the program's last call and gone with it.

Each replica sends its own view of the programs that changed there (`sync`, every ~0.25 s and before
any program read; absolute totals, so a lost or repeated sync does no harm) and gets back, for the
programs it has, the service they received on the other replicas (which PLAS / ATLAS add to their
own: the global figure) and whether a DELETE elsewhere ended them. The merged record sums the
replicas' counters (a replica that has not synced for `stale_s` counts for its totals, not for calls
or KV it held: that is how a dead replica's programs keep their attained service). Bounded: at most
`max_programs` programs (least recently updated dropped first) and one metrics text per live replica.
If the directory restarts it answers with a new `epoch` and every replica sends all it has again.
"""

from __future__ import annotations

import collections
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

SUMMED = ("calls_done", "service_s", "wait_s", "num_prompt_tokens", "num_output_tokens", "num_prefix_hit_tokens",
          "ttl_hits", "ttl_misses", "ttl_expiries", "recomputed_prefill_tokens", "kv_tier_loaded_tokens")
LIVE = ("calls_waiting", "calls_running", "kv_blocks", "kv_blocks_pinned", "kv_blocks_reserved")  # what a replica
# holds now: summed over replicas that are alive and still run the program
MAXED = ("critical_path_s", "num_threads", "ttl_s")


@dataclass(slots=True)
class Entry:
    owner: str | None
    views: dict[str, dict[str, Any]] = field(default_factory=dict)  # replica -> its view (a Program as builtins)
    ended: tuple[float, str] | None = None  # (when, state) once a DELETE ended it: now if it ran somewhere, else
    # its own end (replicas' views whose call started before then end too; a view started after is a new program)


class ProgramDirectory:
    def __init__(self, max_programs: int = 100_000, stale_s: float = 10.0, clock: Callable[[], float] = time.time) -> None:
        self.epoch = uuid.uuid4().hex
        self.max_programs = max_programs
        self.stale_s = stale_s
        self.clock = clock
        self.programs: collections.OrderedDict[str, Entry] = collections.OrderedDict()  # least recently updated first
        self.seen: dict[str, float] = {}  # replica -> its latest sync
        self.texts: dict[str, str] = {}  # replica -> its latest /metrics exposition

    # --- from the replicas -----------------------------------------------------------------------
    def sync(self, replica: str, views: list[dict[str, Any]], active: Iterable[str] = ()) -> dict[str, Any]:
        """Take `replica`'s views of its changed programs (each a Program as builtins plus "owner"); answer
        for those and for `active` (the programs it runs): service elsewhere and whether to end them."""
        now = self.clock()
        self.seen[replica] = now
        for view in views:
            pid = view["id"]
            entry = self.programs.get(pid)
            if entry is None or (view["state"] == "running" and _ended_before(entry, view["created_at"])):
                entry = self.programs[pid] = Entry(view.get("owner"))  # new, or its id started again after its end
            entry.views[replica] = view
            self.programs.move_to_end(pid)
        while len(self.programs) > self.max_programs:
            self.programs.popitem(last=False)
        for gone in [r for r, t in self.seen.items() if now - t > 6 * self.stale_s]:
            del self.seen[gone]
            self.texts.pop(gone, None)
        out = {}
        for pid in {*active, *(v["id"] for v in views)}:
            entry = self.programs.get(pid)
            if entry is None:
                continue
            others = [v for r, v in entry.views.items() if r != replica]
            mine = entry.views.get(replica)
            end = (entry.ended is not None and mine is not None and mine["state"] == "running"
                   and mine["created_at"] <= entry.ended[0])
            out[pid] = {"service_s": sum(v["service_s"] for v in others),
                        "critical_path_s": max((v["critical_path_s"] for v in others), default=0.0), "end": end}
        return {"epoch": self.epoch, "programs": out}

    def metrics(self, replica: str, text: str) -> str:
        """Keep `replica`'s exposition; answer every live replica's, each series labelled by its replica."""
        now = self.clock()
        self.seen[replica] = now
        self.texts[replica] = text
        return merge_expositions({r: t for r, t in self.texts.items() if now - self.seen.get(r, 0.0) <= self.stale_s})

    # --- reads and DELETE (any replica, for its client) --------------------------------------------
    def program(self, pid: str, owner: str | None) -> dict[str, Any] | None:
        entry = self.programs.get(pid)
        if entry is None or entry.owner != owner or not entry.views:
            return None
        return self.merged(pid, entry)

    def claim(self, pid: str, owner: str | None) -> dict[str, Any]:
        """Before a program's first call on a replica: its owner (the first claim of an id that runs nowhere
        makes the caller its owner, at once, so no other key can start it on another replica meanwhile),
        and the service it received so far."""
        entry = self.programs.get(pid)
        if entry is None or _ended_before(entry, float("inf")):
            entry = self.programs[pid] = Entry(owner)
            self.programs.move_to_end(pid)
            while len(self.programs) > self.max_programs:
                self.programs.popitem(last=False)
        if not entry.views:  # claimed, its first view not here yet
            return {"owner": entry.owner, "service_s": 0.0, "critical_path_s": 0.0}
        view = self.merged(pid, entry)
        return {"owner": entry.owner, "service_s": view["service_s"], "critical_path_s": view["critical_path_s"]}

    def known(self, pids: Iterable[str]) -> list[str]:
        return [p for p in pids if p in self.programs and self.programs[p].views]

    def page(self, owner: str | None, state: str | None, limit: int,
             before: tuple[float, str] | None = None) -> list[dict[str, Any]]:
        """`owner`'s programs (in `state`), newest first, those sorting before `before`, at most `limit`."""
        views = [self.merged(pid, e) for pid, e in self.programs.items() if e.owner == owner and e.views]
        keyed = sorted(((v["created_at"], v["id"]), v) for v in views if state is None or v["state"] == state)
        keyed.reverse()
        return [v for k, v in keyed if before is None or k < before][:limit]

    def end(self, pid: str, owner: str | None, state: str = "finished") -> dict[str, Any] | None:
        """A DELETE: the program ends everywhere (replicas still running it end it on their next sync)."""
        entry = self.programs.get(pid)
        if entry is None or entry.owner != owner or not entry.views:
            return None
        if entry.ended is None:  # also when every view has ended: a replica's late view of a call it ran then
            # still ends there (kept: an ended program's own end time and state)
            view = self.merged(pid, entry)
            entry.ended = (self.clock(), state) if view["state"] == "running" else (view["ended_at"], view["state"])
        return self.merged(pid, entry)

    # --- the merged record ---------------------------------------------------------------------
    def merged(self, pid: str, entry: Entry) -> dict[str, Any]:
        now = self.clock()
        views = sorted(entry.views.values(), key=lambda v: v["created_at"])
        first = views[0]
        alive = [v for r, v in entry.views.items()
                 if v["state"] == "running" and now - self.seen.get(r, 0.0) <= self.stale_s]
        out = {k: v for k, v in first.items() if k != "owner"}
        for k in SUMMED:
            out[k] = sum(v.get(k) or 0 for v in views)
        for k in LIVE:
            out[k] = sum(v.get(k) or 0 for v in alive) if entry.ended is None else 0
        for k in MAXED:
            out[k] = max((v.get(k) or 0 for v in views), default=0)
        levels = [v["queue_level"] for v in alive if v.get("queue_level") is not None]
        out["queue_level"] = min(levels) if levels and entry.ended is None else None
        out["error"] = next((v["error"] for v in views if v.get("error")), None)
        out["priority"] = views[-1].get("priority", 0)
        out["replicas"] = sorted(entry.views)
        if entry.ended is not None:
            out["ended_at"], out["state"] = entry.ended
        elif any(v["state"] == "running" for v in views):
            out["ended_at"], out["state"] = None, "running"
        else:
            last = max(views, key=lambda v: v["ended_at"] or 0.0)
            out["ended_at"], out["state"] = last["ended_at"], last["state"]
        return out


def _ended_before(entry: Entry, t: float) -> bool:
    """Has the program ended everywhere (a DELETE, or every replica's view ended) before time `t`?"""
    if entry.ended is not None:
        return entry.ended[0] < t
    views = entry.views.values()
    return bool(views) and all(v["state"] != "running" and (v["ended_at"] or 0.0) < t for v in views)


def merge_expositions(texts: dict[str, str]) -> str:
    """Several Prometheus text expositions as one: each metric family once (its HELP and TYPE lines once),
    every sample with a `replica="<id>"` label added."""
    families: dict[str, tuple[list[str], list[str]]] = {}  # name -> (HELP / TYPE lines, samples), first-seen order
    for replica, text in sorted(texts.items()):
        label = 'replica="' + replica.replace("\\", "\\\\").replace('"', '\\"') + '"'
        current: tuple[list[str], list[str]] | None = None
        for line in text.splitlines():
            if not line:
                continue
            if line.startswith("#"):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    current = families.setdefault(parts[2], ([], []))
                    if line not in current[0]:  # the same HELP / TYPE from every replica: once
                        current[0].append(line)
                continue
            if current is None:
                current = families.setdefault("", ([], []))
            name, brace, rest = line.partition("{")
            if brace:
                sample = f"{name}{{{label},{rest}" if not rest.startswith("}") else f"{name}{{{label}{rest}"
            else:
                name, _, value = line.partition(" ")
                sample = f"{name}{{{label}}} {value}"
            current[1].append(sample)
    lines = []
    for head, samples in families.values():
        lines += head + samples
    return "\n".join(lines) + "\n" if lines else ""

