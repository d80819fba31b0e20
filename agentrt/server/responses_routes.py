"""`POST /v1/responses`: OpenAI's Responses API, streamed and not, over the same call path.

A chain of responses (`previous_response_id`) is one program: the first response starts a program
(or joins the one named by `X-Program-Id` / `program_id`), and every response that continues it
runs in that program, so Responses clients get program-level scheduling without any header.
Stored responses (`store: true`, the default) are kept in memory for the newest ones and in the
server's database for all, with the conversation through them, so a continuation needs only the id.
"""

from __future__ import annotations

import collections
import hashlib
import json
import time
import uuid
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agentrt._chat_plan import Reply
from agentrt._toolcalls import ToolCall, response_format_constraint
from agentrt.engine.outputs import RequestOutput
from agentrt.server.calls import (
    check_capacity,
    reasoning_tokens,
    sampling_params,
    submit,
)
from agentrt.server.errors import APIError, api, bad_request
from agentrt.server.openapi import Operation
from agentrt.server.responses_events import response_events
from agentrt.server.responses_schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    IncompleteDetails,
    InputItem,
    InputMessageItem,
    InputTokensDetails,
    ItemText,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseCreate,
    ResponseDeleted,
    ResponseInputItems,
    ResponseObject,
    ResponseStreamEvent,
    ResponseUsage,
)
from agentrt.server.sse import SSEResponse, results
from agentrt.server.state import ServerState, read_call, state_of
from agentrt.server.store import ResponseRecord


class ResponseMemory:
    """Stored responses: the newest `capacity` in memory (a continuation may come before the
    database write lands), all of them in the store."""

    def __init__(self, store: Any, capacity: int = 1000) -> None:
        self.store = store
        self.capacity = capacity
        self._recent: collections.OrderedDict[str, ResponseRecord] = collections.OrderedDict()

    def put(self, rec: ResponseRecord) -> None:
        self._recent[rec.response_id] = rec
        while len(self._recent) > self.capacity:
            self._recent.popitem(last=False)
        if self.store is not None:
            self.store.put_response(rec)

    async def get(self, response_id: str, owner: str | None) -> ResponseRecord | None:
        rec = self._recent.get(response_id)
        if rec is None and self.store is not None:
            rec = await anyio.to_thread.run_sync(lambda: self.store.get_response(response_id, owner=owner))
        return rec if rec is not None and rec.owner == owner else None

    async def find(self, response_id: str, owner: str | None, param: str) -> ResponseRecord:
        """`get`, or a 404 naming `param` (the field that carried the id)."""
        rec = await self.get(response_id, owner)
        if rec is None:
            raise not_found(response_id, param)
        return rec

    async def delete(self, response_id: str, owner: str | None) -> bool:
        """Forget a response of `owner`'s, in memory and in the store; whether there was one."""
        rec = self._recent.get(response_id)
        in_memory = rec is not None and rec.owner == owner
        if in_memory:
            del self._recent[response_id]
        if self.store is None:
            return in_memory
        in_store = await anyio.to_thread.run_sync(lambda: self.store.delete_response(response_id, owner=owner))
        return in_memory or in_store


def not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"no stored response {response_id!r} (made with store: false, by another key, or never)",
                    "not_found_error", param, "response_not_found")


def _memory(st: ServerState) -> ResponseMemory:
    mem = getattr(st, "responses", None)
    if mem is None:
        mem = st.responses = ResponseMemory(st.store)  # type: ignore[attr-defined]
    return mem


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.text or "" for p in content)
    return content or ""


def input_messages(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """Input items as chat messages; a malformed item is a 400 naming it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, it in enumerate(items):
        where = f"input[{i}]"
        kind = it.type or ("message" if it.role else None)
        if kind == "message":
            if it.role is None:
                raise bad_request(f"{where} is a message without a role", f"{where}.role")
            out.append({"role": "system" if it.role == "developer" else it.role, "content": _text(it.content)})
        elif kind == "function_call":
            if not it.call_id or not it.name or it.arguments is None:
                raise bad_request(f"{where} (function_call) needs call_id, name and arguments", where)
            call = {"id": it.call_id, "name": it.name, "arguments": it.arguments}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "reasoning":
            continue  # an earlier reply's thinking: the template leaves it out of earlier turns
        elif kind == "function_call_output":
            if not it.call_id or it.output is None:
                raise bad_request(f"{where} (function_call_output) needs call_id and output", where)
            out.append({"role": "tool", "content": _text(it.output), "tool_call_id": it.call_id})
        else:
            raise bad_request(f"{where} has an unsupported type {it.type!r} (message, function_call, "
                              "function_call_output)", f"{where}.type")
    if not out:
        raise bad_request("input is empty", "input")
    return out


def _items(reasoning: str | None, content: str | None, calls: list[ToolCall], msg_id: str | None = None,
           rs_id: str | None = None) -> list[OutputItem]:
    items: list[OutputItem] = []
    if reasoning:
        items.append(ReasoningItem(rs_id or f"rs_{uuid.uuid4().hex[:24]}", [ReasoningText(reasoning)]))
    if content:
        items.append(OutputMessage(msg_id or f"msg_{uuid.uuid4().hex[:24]}", [OutputText(content)]))
    items += [FunctionCallItem(f"fc_{uuid.uuid4().hex[:24]}", c.id, c.name, c.arguments) for c in calls]
    return items


def _assistant_message(content: str | None, calls: list[ToolCall]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if calls:
        msg["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]
    return msg


@api
async def create_response(request: Request) -> Response:
    st, who, req = await read_call(request, ResponseCreate)
    owner, pid = who.owner, who.program_id
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        prev = await _memory(st).find(req.previous_response_id, owner, "previous_response_id")
        history = json.loads(prev.messages)
        pid = pid or prev.program_id
    conversation = history + input_messages(req.input)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    tools = [msgspec.structs.asdict(t) for t in req.tools or []]
    choice: Any = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = {"type": "function", "function": {"name": choice.name}}
    fmt = req.text.format if req.text is not None else None
    output = response_format_constraint(msgspec.structs.asdict(fmt) if fmt is not None else None, "text.format")
    prepared = await st.runtime.prepare_chat(messages, tools=tools, tool_choice=choice, output=output, program_id=pid,
                                             tools_when_none=not st.config.exclude_tools_when_tool_choice_none)
    plan, prompt_ids = prepared.plan, prepared.prompt_ids
    params = sampling_params(
        st, max_tokens=req.max_output_tokens, prompt_len=len(prompt_ids), temperature=req.temperature,
        top_p=req.top_p, top_k=None, n=1, stop=None, stop_token_ids=None, seed=None, ignore_eos=False,
        logprobs=False, top_logprobs=0, constraint=plan.constraint, max_tokens_param="max_output_tokens",
    )
    params.skip_special_tokens = params.skip_special_tokens and not plan.special_tokens  # harmony's markup
    check_capacity(st)
    if pid is None:  # a new chain: its own program, ended by the idle timeout or DELETE
        pid = st.runtime.start_program(name=who.name or "responses", owner=owner).program_id
    who.program_id = pid
    call = submit(st, who, prompt_ids, params, "input", kind="responses", cache_salt=req.cache_salt, check=False)
    base = ResponseObject(
        id=f"resp_{uuid.uuid4().hex[:24]}", created_at=int(time.time()), model=st.model_of(call), output=[],
        status="in_progress", usage=None, instructions=req.instructions, tools=req.tools or [],
        tool_choice=req.tool_choice or "auto", parallel_tool_calls=req.parallel_tool_calls,
        temperature=req.temperature, top_p=req.top_p, max_output_tokens=req.max_output_tokens,
        previous_response_id=req.previous_response_id, text=req.text, metadata=req.metadata or {},
        store=req.store, program_id=pid,
    )

    def finish(out: RequestOutput, reply: Reply, msg_id: str | None = None, rs_id: str | None = None) -> ResponseObject:
        n_in, n_out = out.num_prompt_tokens, out.num_output_tokens
        length = out.finish_reason == "length"
        reasoning, content, calls = reply
        done = msgspec.structs.replace(
            base, output=_items(reasoning, content, calls, msg_id, rs_id),
            status="incomplete" if length else "completed",
            usage=ResponseUsage(n_in, n_out, n_in + n_out, InputTokensDetails(out.num_cached_tokens),
                                OutputTokensDetails(reasoning_tokens(st, reasoning))),
            incomplete_details=IncompleteDetails("max_output_tokens") if length else None,
        )
        if req.store:
            _memory(st).put(ResponseRecord(
                done.id, owner, pid, time.time(), msgspec.json.encode(done).decode(),
                json.dumps(conversation + [_assistant_message(content, calls)]),
            ))
        return done

    headers = {"X-Program-Id": pid, "X-Response-Id": base.id}  # a router learns which program a chain is
    if req.stream:
        return SSEResponse(response_events(call, plan, base, finish), headers)
    (out,) = await results(request, [call])
    return Response(msgspec.json.encode(finish(out, plan.split(out.text))), headers=headers,
                    media_type="application/json")


@api
async def retrieve_response(request: Request) -> Response:
    """A stored response (`store: true`, the default) by id, to the key that created it (others: 404)."""
    st = state_of(request)
    owner = st.owner(request)
    rec = await _memory(st).find(request.path_params["response_id"], owner, "response_id")
    return Response(rec.body.encode(), headers={"X-Program-Id": rec.program_id}, media_type="application/json")


@api
async def delete_response(request: Request) -> Response:
    """Delete a stored response of the caller's key (others: 404). A chain that continues it by
    `previous_response_id` afterwards gets a 404; its program is untouched (end it with
    `DELETE /v1/programs/{id}`)."""
    st = state_of(request)
    response_id = request.path_params["response_id"]
    if not await _memory(st).delete(response_id, st.owner(request)):
        raise not_found(response_id, "response_id")
    return Response(msgspec.json.encode(ResponseDeleted(response_id)), media_type="application/json")


def conversation_items(response_id: str, messages: list[dict[str, Any]]) -> list[Any]:
    """A stored conversation's chat messages as Responses items, ids stable per response and position."""
    def item_id(prefix: str, k: int) -> str:
        return f"{prefix}_{hashlib.sha1(f'{response_id}/{k}'.encode()).hexdigest()[:24]}"

    items: list[Any] = []
    for m in messages:
        if m["role"] == "tool":
            items.append(FunctionCallOutputItem(item_id("fco", len(items)), m["tool_call_id"], m["content"]))
            continue
        if m["content"] or not m.get("tool_calls"):
            kind = "output_text" if m["role"] == "assistant" else "input_text"
            items.append(InputMessageItem(item_id("msg", len(items)), m["role"], [ItemText(kind, m["content"])]))
        for c in m.get("tool_calls", []):
            items.append(FunctionCallItem(item_id("fc", len(items)), c["id"], c["name"], c["arguments"]))
    return items


@api
async def list_input_items(request: Request) -> Response:
    """The input items of a stored response (OpenAI's list): newest first by default (`order=asc` for
    oldest), `limit` 1-100 (20), `after` an item id from a previous page."""
    st = state_of(request)
    rec = await _memory(st).find(request.path_params["response_id"], st.owner(request), "response_id")
    q = request.query_params
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise bad_request(f"limit must be an integer from 1 to 100, got {q.get('limit')!r}", "limit")
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be 'asc' or 'desc', got {order!r}", "order")
    items = conversation_items(rec.response_id, json.loads(rec.messages)[:-1])  # the last one is the reply
    if order == "desc":
        items.reverse()
    start = 0
    if (after := q.get("after")) is not None:
        ids = [it.id for it in items]
        if after not in ids:
            raise bad_request(f"after={after!r} is not an input item of response {rec.response_id!r}", "after")
        start = ids.index(after) + 1
    page = items[start : start + limit]
    body = ResponseInputItems(page, page[0].id if page else None, page[-1].id if page else None,
                              start + limit < len(items))
    return Response(msgspec.json.encode(body), media_type="application/json")


ROUTES = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
    Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
]

OPERATIONS = [
    Operation("post", "/v1/responses", "create a model response (OpenAI Responses API)", ResponseObject,
              ResponseCreate, streams=ResponseStreamEvent, errors=(400, 401, 404, 409, 413, 429, 500, 503)),
    Operation("get", "/v1/responses/{response_id}", "a stored response (OpenAI Responses API)", ResponseObject,
              errors=(401, 404, 500)),
    Operation("delete", "/v1/responses/{response_id}", "delete a stored response (OpenAI Responses API)",
              ResponseDeleted, errors=(401, 404, 500)),
    Operation("get", "/v1/responses/{response_id}/input_items", "the input items of a stored response (OpenAI "
              "Responses API)", ResponseInputItems, errors=(400, 401, 404, 500),
              query=(("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
                     ("order", {"type": "string", "enum": ["asc", "desc"]}), ("after", {"type": "string"}))),
]
