"""`/v1/programs`: start, list, inspect and end the programs that calls are keyed by.

Live programs come from the runtime's process table; programs of earlier server runs (or ended
ones the table no longer keeps) from the store. A program belongs to the API key that started it:
other keys get 404 for it.
"""

from __future__ import annotations

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agentrt._errors import ProgramNotFoundError
from agentrt._process_table import ProgramInfo
from agentrt.server.bodies import json_response, read_body
from agentrt.server.state import ServerState, state_of
from agentrt.server.errors import APIError, api, bad_request
from agentrt.server.openapi import Operation
from agentrt.server.program_schemas import Program, ProgramCall, ProgramCallList, ProgramCreate, ProgramList
from agentrt.server.recorder import wall_time
from agentrt.server.schemas import decode
from agentrt.server.store import ProgramRecord


def live_view(st: ServerState, info: ProgramInfo) -> Program:
    rt = st.runtime
    pid = info.program_id
    kv = rt.program_kv(pid) if info.state == "running" else info.kv
    retention = {} if kv is None else {
        "kv_blocks_pinned": kv.pinned, "kv_blocks_reserved": kv.reserved, "ttl_s": kv.ttl_s, "ttl_hits": kv.ttl_hits,
        "ttl_misses": kv.ttl_misses, "ttl_expiries": kv.expiries, "recomputed_prefill_tokens": kv.recomputed_prefill_tokens,
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
    st = state_of(request)
    owner = st.owner(request)
    limit = _int_param(request, "limit", 100, 1, 1000)
    state = request.query_params.get("state")
    live = [p for p in st.runtime.programs if p.owner == owner and (state is None or p.state == state)]
    live.sort(key=lambda p: p.start_time, reverse=True)
    views = [live_view(st, p) for p in live[:limit]]
    if len(views) < limit and st.store is not None:
        seen = {v.id for v in views}
        stored = await anyio.to_thread.run_sync(lambda: st.store.list_programs(owner=owner, state=state, limit=limit))
        views += [stored_view(r) for r in stored if r.program_id not in seen][: limit - len(views)]
    return json_response(ProgramList(views))


async def _find(st: ServerState, pid: str, owner: str | None) -> Program:
    info = st.runtime.programs.get(pid)
    if info is not None:
        if info.owner != owner:
            raise ProgramNotFoundError("no such program", program_id=pid)
        return live_view(st, info)
    if st.store is not None:
        rec = await anyio.to_thread.run_sync(lambda: st.store.get_program(pid, owner=owner))
        if rec is not None:
            return stored_view(rec)
    raise ProgramNotFoundError("no such program", program_id=pid)


@api
async def get_program(request: Request) -> Response:
    st = state_of(request)
    owner = st.owner(request)
    return json_response(await _find(st, request.path_params["program_id"], owner))


@api
async def end_program(request: Request) -> Response:
    """End a running program: abort its calls in flight, release all it holds. Ending an ended
    program is a no-op that returns its record."""
    st = state_of(request)
    owner = st.owner(request)
    pid = request.path_params["program_id"]
    info = st.runtime.programs.get(pid)
    if info is not None and info.owner == owner and info.state == "running":
        info = st.runtime.end_program(pid, owner=owner)
        return json_response(live_view(st, info))
    return json_response(await _find(st, pid, owner))


@api
async def list_program_calls(request: Request) -> Response:
    """A program's ended calls in arrival order, from the store (so with `--db none` there are none to show)."""
    st = state_of(request)
    owner = st.owner(request)
    pid = request.path_params["program_id"]
    limit = _int_param(request, "limit", 100, 1, 1000)
    await _find(st, pid, owner)  # 404 for an unknown program or another key's
    if st.store is None:
        raise APIError(409, "calls are recorded only with a store: this server runs with --db none",
                       "invalid_request_error", None, "no_store")
    store = st.store

    def read() -> list[ProgramCall]:
        store.flush()  # the calls that ended just now are still in the write-behind queue
        return [ProgramCall(c.request_id, c.thread_id, c.kind, c.arrival_at, c.finished_at, c.first_token_s,
                            c.latency_s, c.service_s, c.num_prompt_tokens, c.num_output_tokens, c.finish_reason,
                            c.error) for c in store.list_calls(pid, limit)]

    return json_response(ProgramCallList(await anyio.to_thread.run_sync(read)))


ROUTES = [
    Route("/v1/programs", create_program, methods=["POST"]),
    Route("/v1/programs", list_programs, methods=["GET"]),
    Route("/v1/programs/{program_id}", get_program, methods=["GET"]),
    Route("/v1/programs/{program_id}", end_program, methods=["DELETE"]),
    Route("/v1/programs/{program_id}/calls", list_program_calls, methods=["GET"]),
]

OPERATIONS = [
    Operation("post", "/v1/programs", "start a program", Program, ProgramCreate, errors=(400, 401, 409, 413, 500),
              ok=201),
    Operation("get", "/v1/programs", "list programs", ProgramList, errors=(400, 401, 500),
              query=(("limit", {"type": "integer", "minimum": 1, "maximum": 1000}), ("state", {"type": "string"}))),
    Operation("get", "/v1/programs/{program_id}", "a program's state", Program, errors=(401, 404, 500)),
    Operation("delete", "/v1/programs/{program_id}", "end a program", Program, errors=(401, 404, 500)),
    Operation("get", "/v1/programs/{program_id}/calls", "a program's calls", ProgramCallList, errors=(400, 401, 404, 409, 500),
              query=(("limit", {"type": "integer", "minimum": 1, "maximum": 1000}),)),
]
