"""What the live page draws: a program's timeline (`GET /v1/programs/{id}/timeline`, drawn at
`GET /ui/programs/{id}`) and the last 15 minutes of the server's state (`GET /v1/stats/history`).

A timeline is built from the records the server keeps (agentrt._timeline): the store's call records of the
program's ended calls (so a finished program's timeline comes back after a restart) and, while it runs, its
calls in flight from the process table and the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from agentrt._process_table import ProgramInfo
from agentrt._timeline import Timeline, build_timeline, in_flight
from agentrt.server.bodies import json_response
from agentrt.server.errors import APIError, api, bad_request
from agentrt.server.history import Sample
from agentrt.server.openapi import Operation
from agentrt.server.program_routes import _locate
from agentrt.server.program_schemas import Program
from agentrt.server.state import state_of
from agentrt.server.timeline_page import PROGRAM_PAGE

MAX_CALLS = 20_000  # calls drawn per program at most (its first ones)


@dataclass(slots=True)
class StatsHistory:
    interval_s: float  # seconds between samples
    data: list[Sample]  # oldest first


@api
async def program_timeline(request: Request) -> Response:
    st = state_of(request)
    owner = st.owner(request)
    pid = request.path_params["program_id"]
    found = await _locate(st, pid, owner)  # 404 for an unknown program or another key's
    to_wall = time.time() - time.monotonic()
    live = st.runtime.programs.get(pid)
    calls = in_flight(live, st.runtime.engine, to_wall) if live is not None and live.owner == owner else []
    if isinstance(found, ProgramInfo):
        name, state, started = found.name, found.state, found.start_time + to_wall
        ended = None if found.end_time is None else found.end_time + to_wall
    elif isinstance(found, Program):  # replicas: the directory's merged record
        name, state, started, ended = found.name, found.state, found.created_at, found.ended_at
    else:
        name, state, started, ended = found.name, found.state, found.created_at, found.ended_at
    if st.store is not None:
        store = st.store

        def read() -> list:
            store.flush()  # the calls that ended just now are still in the write-behind queue
            return store.list_calls(pid, MAX_CALLS)

        ended_calls = await anyio.to_thread.run_sync(read)
    elif st.runtime.timelines is not None:
        ended_calls = list(st.runtime.timelines.calls.get(pid, ()))
    else:
        raise APIError(409, "timelines are drawn from the call records: this server runs with --db none",
                       "invalid_request_error", None, "no_store")
    done = {c.request_id for c in ended_calls}  # a call that ended since the look at those in flight: its record
    tl = build_timeline(pid, name, state, started, ended, [*ended_calls, *(c for c in calls if c.request_id not in done)])
    return json_response(tl)


@api
async def stats_history(request: Request) -> Response:
    """The samples of the last 15 minutes, oldest first; `since` (epoch s): only those after it."""
    st = state_of(request)
    st.owner(request)
    raw = request.query_params.get("since")
    since = None
    if raw is not None:
        try:
            since = float(raw)
        except ValueError:
            raise bad_request(f"query parameter since={raw!r} is not a number (epoch seconds)", "since") from None
    return json_response(StatsHistory(st.history.interval_s, st.history.since(since)))


async def program_page(request: Request) -> Response:
    return HTMLResponse(PROGRAM_PAGE, headers={"Cache-Control": "no-store"})


ROUTES = [
    Route("/v1/programs/{program_id}/timeline", program_timeline, methods=["GET"]),
    Route("/v1/stats/history", stats_history, methods=["GET"]),
    Route("/ui/programs/{program_id}", program_page, methods=["GET"]),
]

OPERATIONS = [
    Operation("get", "/v1/programs/{program_id}/timeline", "a program's timeline: its calls' phases per thread, "
              "tool gaps, preemptions, pins, totals", Timeline, errors=(401, 404, 409, 500)),
    Operation("get", "/v1/stats/history", "the server's state sampled each second, the last 15 minutes",
              StatsHistory, errors=(400, 401, 500), query=(("since", {"type": "number"}),)),
    Operation("get", "/ui/programs/{program_id}", "a program's timeline, drawn", None, media_type="text/html",
              errors=(), auth=False),
]
