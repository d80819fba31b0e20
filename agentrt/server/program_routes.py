"""`/v1/programs`: start, list, inspect and end the programs that calls are keyed by. Lists page by
cursor as OpenAI's do (`limit`, `after`; `has_more`, `first_id`, `last_id`).

Live programs come from the runtime's process table; programs of earlier server runs (or ended
ones the table no longer keeps) from the store. A program belongs to the API key that started it:
other keys get 404 for it.
"""

from __future__ import annotations

import time

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agentrt._errors import ProgramNotFoundError
from agentrt._process_table import ProgramInfo
from agentrt.server.bodies import json_response, read_body
from agentrt.server.errors import APIError, api, bad_request
from agentrt.server.openapi import Operation
from agentrt.server.program_schemas import Program, ProgramCall, ProgramCallList, ProgramCreate, ProgramList
from agentrt.server.recorder import wall_time
from agentrt.server.schemas import decode
from agentrt.server.state import ServerState, state_of
from agentrt.server.store import ProgramRecord


def live_view(st: ServerState, info: ProgramInfo) -> Program:
    rt = st.runtime
    pid = info.program_id
    kv = rt.program_kv(pid) if info.state == "running" else info.kv
    retention = {} if kv is None else {
        "kv_blocks_pinned": kv.pinned, "kv_blocks_reserved": kv.reserved, "ttl_s": kv.ttl_s, "ttl_hits": kv.ttl_hits,
        "ttl_misses": kv.ttl_misses, "ttl_expiries": kv.expiries, "recomputed_prefill_tokens": kv.recomputed_prefill_tokens,
        "kv_tier_loaded_tokens": kv.tier_loaded_tokens,
    }
    return Program(
        id=pid, name=info.name, state=info.state, created_at=wall_time(info.start_time),
        ended_at=None if info.end_time is None else wall_time(info.end_time), calls_waiting=info.calls_waiting,
        calls_running=info.calls_running, calls_done=info.calls_done, service_s=info.service_s,
        critical_path_s=info.critical_path_s, wait_s=info.wait_s, num_prompt_tokens=info.num_prompt_tokens,
        num_output_tokens=info.num_output_tokens, queue_level=rt.program_queue_level(pid),
        kv_blocks=rt.program_kv_blocks(pid) if info.state == "running" else 0, num_threads=info.num_threads,
        num_prefix_hit_tokens=info.num_prefix_hit_tokens, error=info.error, priority=info.priority, **retention,
    )


def stored_view(rec: ProgramRecord) -> Program:
    return Program(
        id=rec.program_id, name=rec.name, state=rec.state, created_at=rec.created_at, ended_at=rec.ended_at,
        calls_waiting=0, calls_running=0, calls_done=rec.calls_done, service_s=rec.service_s, critical_path_s=0.0,
        wait_s=rec.wait_s, num_prompt_tokens=rec.num_prompt_tokens, num_output_tokens=rec.num_output_tokens,
        queue_level=None, kv_blocks=0, num_threads=0, error=rec.error, live=False,
    )


@api
async def create_program(request: Request) -> Response:
    st = state_of(request)
    owner = st.owner(request)
    body = await read_body(request, st.config.max_body_bytes)
    spec = decode(body, ProgramCreate) if body.strip() else ProgramCreate()
    info = st.runtime.start_program(spec.program_id, name=spec.name, owner=owner, priority=spec.priority)
    return json_response(live_view(st, info), 201)


def _int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        v = int(raw)
    except ValueError:
        raise bad_request(f"query parameter {name}={raw!r} is not an integer", name) from None
    if not lo <= v <= hi:
        raise bad_request(f"query parameter {name}={v} is outside [{lo}, {hi}]", name)
    return v


@api
async def list_programs(request: Request) -> Response:
    """The key's programs, newest first, a page at a time: `limit` (default 100), `state`, and `after` (the
    `last_id` of the page before); `has_more` says whether another page follows. Live programs come from
    the process table, the others from the store."""
    st = state_of(request)
    owner = st.owner(request)
    limit = _int_param(request, "limit", 100, 1, 1000)
    state = request.query_params.get("state")
    after = request.query_params.get("after")
    to_wall = time.time() - time.monotonic()  # one offset for the whole page: keys compare exactly
    cursor = None
    if after is not None:
        try:
            cursor = _page_key(await _locate(st, after, owner), to_wall)
        except ProgramNotFoundError:
            raise bad_request(f"query parameter after={after!r} is not one of your programs", "after") from None
    rows: list[tuple[tuple[float, str], ProgramInfo | ProgramRecord | Program]]
    if st.peers is not None:  # replicas: every replica's programs, merged, from the directory
        views = [msgspec.convert(v, Program) for v in await st.peers.programs(owner, state, limit + 1, cursor)]
        rows = [((v.created_at, v.id), v) for v in views]
    else:
        rows = [((p.start_time + to_wall, p.program_id), p) for p in st.runtime.programs
                if p.owner == owner and (state is None or p.state == state)]
        rows = [r for r in rows if cursor is None or r[0] < cursor]
    if st.store is not None:
        live_ids = {r[0][1] for r in rows} | {p.program_id for p in st.runtime.programs if p.owner == owner}
        stored = await anyio.to_thread.run_sync(lambda: st.store.list_programs(
            owner=owner, state=state, limit=limit + 1 + len(live_ids), before=cursor))
        stored = [r for r in stored if r.program_id not in live_ids]
        if st.peers is not None:  # a program the directory knows is in `rows` already, or on a later page
            known = await st.peers.known([r.program_id for r in stored])
            stored = [r for r in stored if r.program_id not in known]
        rows += [((r.created_at, r.program_id), r) for r in stored]
    rows.sort(key=lambda r: r[0], reverse=True)
    page = [_view(st, p) for _, p in rows[:limit]]
    return json_response(ProgramList(page, has_more=len(rows) > limit, first_id=page[0].id if page else None,
                                     last_id=page[-1].id if page else None))


def _page_key(found: ProgramInfo | ProgramRecord | Program, to_wall: float) -> tuple[float, str]:
    """Where a program sorts in a page: (created_at, id), a live one's start time made wall time by `to_wall`."""
    if isinstance(found, ProgramInfo):
        return found.start_time + to_wall, found.program_id
    if isinstance(found, Program):
        return found.created_at, found.id
    return found.created_at, found.program_id


async def _locate(st: ServerState, pid: str, owner: str | None) -> ProgramInfo | ProgramRecord | Program:
    """The program: across replicas the directory's merged record; else the process table's, else the store's;
    ProgramNotFoundError if none holds it for `owner`."""
    if st.peers is not None:
        view = await st.peers.program(pid, owner)
        if view is not None:
            return msgspec.convert(view, Program)
    info = st.runtime.programs.get(pid)
    if info is not None:
        if info.owner != owner:
            raise ProgramNotFoundError("no such program", program_id=pid)
        return info
    if st.store is not None:
        rec = await anyio.to_thread.run_sync(lambda: st.store.get_program(pid, owner=owner))
        if rec is not None:
            return rec
    raise ProgramNotFoundError("no such program", program_id=pid)


def _view(st: ServerState, found: ProgramInfo | ProgramRecord | Program) -> Program:
    if isinstance(found, Program):
        return found
    return live_view(st, found) if isinstance(found, ProgramInfo) else stored_view(found)


@api
async def get_program(request: Request) -> Response:
    st = state_of(request)
    owner = st.owner(request)
    return json_response(_view(st, await _locate(st, request.path_params["program_id"], owner)))


@api
async def end_program(request: Request) -> Response:
    """End a running program: abort its calls in flight, release all it holds. Ending an ended
    program is a no-op that returns its record. A program recorded as running that no server runs
    (its server was killed) is closed as `interrupted`: a DELETE always leaves a program ended."""
    st = state_of(request)
    owner = st.owner(request)
    pid = request.path_params["program_id"]
    if st.peers is not None:  # replicas: ended here, then everywhere else on their next sync
        info = st.runtime.programs.get(pid)
        if info is not None and info.owner == owner and info.state == "running":
            st.runtime.end_program(pid, owner=owner)
        view = await st.peers.end(pid, owner)
        if view is not None:
            return json_response(msgspec.convert(view, Program))
    found = await _locate(st, pid, owner)
    if isinstance(found, Program):
        return json_response(found)
    if isinstance(found, ProgramInfo):
        if found.state == "running":
            found = st.runtime.end_program(pid, owner=owner)
        return json_response(live_view(st, found))
    if found.state == "running" and st.store is not None:
        store = st.store

        def close() -> ProgramRecord | None:
            store.interrupt_running(time.time(), program_id=pid)
            return store.get_program(pid, owner=owner)

        found = await anyio.to_thread.run_sync(close) or found
    return json_response(stored_view(found))


@api
async def list_program_calls(request: Request) -> Response:
    """A program's ended calls in arrival order, from the store (so with `--db none` there are none to show),
    a page at a time: `limit` (default 100) and `after` (the `last_id` of the page before)."""
    st = state_of(request)
    owner = st.owner(request)
    pid = request.path_params["program_id"]
    limit = _int_param(request, "limit", 100, 1, 1000)
    after = request.query_params.get("after")
    await _locate(st, pid, owner)  # 404 for an unknown program or another key's
    if st.store is None:
        raise APIError(409, "calls are recorded only with a store: this server runs with --db none",
                       "invalid_request_error", None, "no_store")
    store = st.store

    def read() -> list[ProgramCall]:
        store.flush()  # the calls that ended just now are still in the write-behind queue
        return [ProgramCall(c.request_id, c.thread_id, c.kind, c.arrival_at, c.finished_at, c.first_token_s,
                            c.latency_s, c.service_s, c.num_prompt_tokens, c.num_output_tokens, c.finish_reason,
                            c.error) for c in store.list_calls(pid, limit + 1, after=after)]

    try:
        calls = await anyio.to_thread.run_sync(read)
    except LookupError:
        raise bad_request(f"query parameter after={after!r} is not a call of program {pid!r}", "after") from None
    page = calls[:limit]
    return json_response(ProgramCallList(page, has_more=len(calls) > limit, first_id=page[0].id if page else None,
                                         last_id=page[-1].id if page else None))


ROUTES = [
    Route("/v1/programs", create_program, methods=["POST"]),
    Route("/v1/programs", list_programs, methods=["GET"]),
    Route("/v1/programs/{program_id}", get_program, methods=["GET"]),
    Route("/v1/programs/{program_id}", end_program, methods=["DELETE"]),
    Route("/v1/programs/{program_id}/calls", list_program_calls, methods=["GET"]),
]

_LIMIT = ("limit", {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100})
_AFTER = ("after", {"type": "string", "description": "the last_id of the page before: the next page"})
OPERATIONS = [
    Operation("post", "/v1/programs", "start a program", Program, ProgramCreate, errors=(400, 401, 409, 413, 500),
              ok=201),
    Operation("get", "/v1/programs", "list programs", ProgramList, errors=(400, 401, 500),
              query=(_LIMIT, ("state", {"type": "string"}), _AFTER)),
    Operation("get", "/v1/programs/{program_id}", "a program's state", Program, errors=(401, 404, 500)),
    Operation("delete", "/v1/programs/{program_id}", "end a program", Program, errors=(401, 404, 500)),
    Operation("get", "/v1/programs/{program_id}/calls", "a program's calls", ProgramCallList, errors=(400, 401, 404, 409, 500),
              query=(_LIMIT, _AFTER)),
]
