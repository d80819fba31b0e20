"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API, streamed and
not, over the same call path as the chat endpoint, so Anthropic's SDKs and the agent frameworks
built on them work unchanged.

A request becomes the chat messages the OpenAI endpoint would see: `system` first, an assistant
message's `tool_use` blocks as its tool calls, a user message's `tool_result` blocks as tool results
(each answering an earlier tool_use), tools as function tools, `tool_choice` any / tool / none as
"required" / a named function / "none", `output_config.format` (a JSON schema) as the chat endpoint's
json_schema response format. A last assistant message is a prefill: the reply goes on
from it (the template's continue_final_message). The call belongs to the program named by
`X-Program-Id` (threads: `X-Thread-Id`), as on the other endpoints. Errors come in Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`, plus agentrt's `param`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agentrt._call import Call
from agentrt._chat_plan import ChatPlan, Reply, plan_call
from agentrt._errors import AgentrtError
from agentrt._toolcalls import check_schema
from agentrt.engine.outputs import RequestOutput
from agentrt.engine.structured import Constraint
from agentrt.server.bodies import read_body
from agentrt.server.calls import (
    sampling_params,
    submit,
)
from agentrt.server.errors import APIError, api_with, bad_request, to_api_error
from agentrt.server.messages_schemas import (
    AnthropicError,
    AnthropicErrorInfo,
    ContentBlock,
    CountTokensRequest,
    CountTokensResponse,
    Message,
    MessagesRequest,
    MessageStreamEvent,
    MessageUsage,
    TextBlock,
    TextPart,
    ThinkingBlock,
    ToolUseBlock,
)
from agentrt.server.openapi import Operation
from agentrt.server.schemas import decode
from agentrt.server.sse import SSEResponse, results
from agentrt.server.state import ServerState, read_call, state_of

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def _error_info(err: APIError) -> AnthropicErrorInfo:
    kind = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return AnthropicErrorInfo(kind, err.message, err.param)


anthropic_api = api_with(lambda err: msgspec.json.encode(AnthropicError(_error_info(err))))  # Anthropic's errors


# --- the request as chat messages -------------------------------------------------------------
def _text(parts: str | list[TextPart] | None, where: str) -> str:
    if parts is None or isinstance(parts, str):
        return parts or ""
    bad = [k for k, p in enumerate(parts) if p.type != "text"]
    if bad:
        raise bad_request(f"{where}[{bad[0]}] has type {parts[bad[0]].type!r}: only text is supported",
                          f"{where}[{bad[0]}].type")
    return "".join(p.text or "" for p in parts)


def chat_messages(req: MessagesRequest | CountTokensRequest) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The request's conversation as chat messages, and the tool name of every tool_use id in it; a
    malformed block is a 400 naming it."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system, "system")})
    names: dict[str, str] = {}  # tool_use id -> tool name
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if b.type == "text":
                text.append(b.text or "")
            elif b.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # an earlier reply's thinking: the template leaves it out of earlier turns
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.id or not b.name or b.input is None:
                    raise bad_request(f"{where} (tool_use) needs id, name and input", where)
                calls.append({"id": b.id, "name": b.name, "arguments": json.dumps(b.input)})
                names[b.id] = b.name
            elif b.type == "tool_result" and m.role == "user":
                if b.tool_use_id not in names:
                    raise bad_request(f"{where}.tool_use_id {b.tool_use_id!r} answers no earlier tool_use block",
                                      f"{where}.tool_use_id")
                if text:  # text before a result: its own user turn
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                result = _text(b.content, f"{where}.content")
                out.append({"role": "tool", "content": f"Error: {result}" if b.is_error else result,
                            "tool_call_id": b.tool_use_id})
            else:
                allowed = "text, tool_use, thinking" if m.role == "assistant" else "text, tool_result"
                raise bad_request(f"{where} has type {b.type!r}, which a {m.role} message cannot carry "
                                  f"(supported: {allowed})", f"{where}.type")
        if m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif text or not out or out[-1]["role"] != "tool":
            out.append({"role": "user", "content": "".join(text)})
    return out, names


def _tools(req: MessagesRequest | CountTokensRequest) -> tuple[list[dict[str, Any]] | None, Any]:
    """Tools and tool_choice in the chat endpoint's form."""
    tools = None
    if req.tools:
        bad = [k for k, t in enumerate(req.tools) if t.type not in (None, "custom")]
        if bad:
            raise bad_request(f"tools[{bad[0]}] has type {req.tools[bad[0]].type!r}: only custom (client) tools are "
                              "supported", f"tools[{bad[0]}].type")
        for k, t in enumerate(req.tools):  # named here by Anthropic's field, not the chat endpoint's
            check_schema(t.input_schema, f"tools[{k}].input_schema")
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.input_schema}} for t in req.tools]
    tc = req.tool_choice
    if tc is None:
        return tools, None
    if tc.type in ("any", "tool") and not tools:
        raise bad_request(f"tool_choice {tc.type!r} needs tools", "tool_choice")
    if tc.type == "tool":
        if not tc.name:
            raise bad_request("tool_choice of type 'tool' needs the tool's name", "tool_choice.name")
        return tools, {"type": "function", "function": {"name": tc.name}}
    return tools, {"auto": "auto", "any": "required", "none": "none"}[tc.type]


def _template_options(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """A last assistant message is a prefill: the reply continues it."""
    if messages[-1]["role"] != "assistant":
        return {}
    if messages[-1].get("tool_calls"):
        raise bad_request("the last message is an assistant tool_use: send its tool_result in a user message",
                          f"messages[{len(messages) - 1}]")
    return {"add_generation_prompt": False, "continue_final_message": True}


def _answered_tool(req: MessagesRequest, names: dict[str, str]) -> str | None:
    """The tool the last user message's tool_result answers, if any (calls.note_tool)."""
    last = req.messages[-1]
    if last.role != "user" or isinstance(last.content, str):
        return None
    used = [names[b.tool_use_id] for b in last.content if b.type == "tool_result" and b.tool_use_id in names]
    return used[-1] if used else None


# --- the reply --------------------------------------------------------------------------------
def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _message(out: RequestOutput, plan: ChatPlan, req: MessagesRequest, msg_id: str, model: str) -> tuple[Message, Reply]:
    c = out.outputs[0]
    reply = plan.split(c.text)
    reasoning, content, calls = reply
    if req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use:
        calls = calls[:1]
    blocks: list[ContentBlock] = [ThinkingBlock(reasoning)] if reasoning else []
    blocks += [TextBlock(content)] if content else []
    blocks += [ToolUseBlock("toolu_" + k.id.removeprefix("call_"), k.name, _input(k.arguments)) for k in calls]
    if calls:
        reason = "tool_use"
    elif c.finish_reason == "length":
        reason = "max_tokens"
    elif isinstance(c.stop_reason, str):
        reason = "stop_sequence"
    else:
        reason = "end_turn"
    cached = out.num_cached_tokens
    usage = MessageUsage(out.num_prompt_tokens - cached, out.num_output_tokens, cached)
    msg = Message(msg_id, model, blocks, reason, c.stop_reason if reason == "stop_sequence" else None, usage)
    return msg, reply


@anthropic_api
async def create_message(request: Request) -> Response:
    st, who, req = await read_call(request, MessagesRequest)
    messages, names = chat_messages(req)
    tools, choice = _tools(req)
    empty = [k for k, seq in enumerate(req.stop_sequences or []) if not seq]
    if empty:
        raise bad_request("stop sequences must be non-empty strings", f"stop_sequences[{empty[0]}]")
    fmt = req.output_config.format if req.output_config is not None else None
    output = None
    if fmt is not None:
        check_schema(fmt.schema, "output_config.format.schema")
        output = Constraint.json_schema(fmt.schema)
    prepared = await st.runtime.prepare_chat(messages, tools=tools, tool_choice=choice, output=output,
                                             output_param="output_config.format", program_id=who.program_id,
                                             tools_when_none=not st.config.exclude_tools_when_tool_choice_none,
                                             **_template_options(messages))
    plan, prompt_ids = prepared.plan, prepared.prompt_ids
    params = sampling_params(
        st, max_tokens=req.max_tokens, prompt_len=len(prompt_ids), temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, n=1, stop=req.stop_sequences, stop_token_ids=None, seed=None, ignore_eos=False,
        logprobs=False, top_logprobs=0, constraint=plan.constraint,
    )
    params.skip_special_tokens = params.skip_special_tokens and not plan.special_tokens  # harmony's markup
    call = submit(st, who, prompt_ids, params, "messages", kind="messages", tool=_answered_tool(req, names))
    msg_id = f"msg_{uuid.uuid4().hex[:24]}"
    if req.stream:
        return SSEResponse(_events(st, call, plan, req, msg_id, len(prompt_ids)), {"X-Program-Id": call.program_id})
    (out,) = await results(request, [call])
    msg, _ = _message(out, plan, req, msg_id, st.model_of(call))
    return Response(msgspec.json.encode(msg), headers={"X-Program-Id": call.program_id}, media_type="application/json")


def _event(kind: str, **payload: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode({"type": kind, **payload}) + b"\n\n"


class _Block:
    """A thinking or text block streamed as it grows."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "thinking" | "text"
        self.index: int | None = None  # once started
        self.sent = ""  # streamed so far
        self.stopped = False

    def start(self, index: int) -> bytes:
        self.index = index
        return _event("content_block_start", index=index,
                      content_block=ThinkingBlock("") if self.kind == "thinking" else TextBlock(""))

    def delta(self, text: str, index: int) -> list[bytes]:
        """`text` streamed, the block started at `index` first if it is not yet."""
        out = [self.start(index)] if self.index is None else []
        self.sent += text
        delta = {"type": f"{self.kind}_delta", self.kind: text}
        out.append(_event("content_block_delta", index=self.index, delta=delta))
        return out

    def stop(self, text: str, index: int) -> list[bytes]:
        """The block's whole text (started at `index` if it is not yet): what was held back (a partial tag,
        text that might have been a call), then its end."""
        self.stopped = True
        out = [self.start(index)] if self.index is None else []
        rest = text[len(self.sent):] if text.startswith(self.sent) else ""
        if rest:
            out += self.delta(rest, index)
        if self.kind == "thinking":  # Anthropic's streams sign a thinking block before it stops
            delta = {"type": "signature_delta", "signature": ""}
            out.append(_event("content_block_delta", index=self.index, delta=delta))
        out.append(_event("content_block_stop", index=self.index))
        return out


async def _events(st: ServerState, call: Call, plan: ChatPlan, req: MessagesRequest, msg_id: str,
                  prompt_tokens: int) -> AsyncIterator[bytes]:
    """The event sequence Anthropic's SDKs parse: message_start (once the first token is there, so its
    usage splits the prompt between computed and cached tokens), each content block's start, deltas and
    stop (thinking, with a reasoning parser, then text, as generated; tool_use blocks, held back from the
    text, when the reply ends), then message_delta with the stop reason and the usage, and message_stop."""
    streamer = plan.streamer()
    thought, said = _Block("thinking"), _Block("text")
    started = False

    def start(cached: int) -> list[bytes]:
        usage = MessageUsage(prompt_tokens - cached, 0, cached)
        return [_event("message_start", message=Message(msg_id, st.model_of(call), [], None, None, usage)), _event("ping")]

    async with call:
        try:
            async for d in call:
                if not started:
                    started = True
                    for e in start(d.num_cached_tokens or 0):
                        yield e
                reasoning, show = streamer.feed(d.new_text)
                for e in thought.delta(reasoning, 0) if reasoning else ():
                    yield e
                if show:
                    if thought.index is not None and not thought.stopped:  # the answer began: the thinking is over
                        for e in thought.stop(thought.sent, 0):
                            yield e
                    for e in said.delta(show, 0 if thought.index is None else 1):
                        yield e
            out = await call.result()
        except AgentrtError as e:
            yield _event("error", error=_error_info(to_api_error(e)))
            return
    msg, (reasoning, content, _) = _message(out, plan, req, msg_id, st.model_of(call))
    if not started:
        for e in start(msg.usage.cache_read_input_tokens):
            yield e
    index = 0
    if reasoning or thought.index is not None:
        for e in () if thought.stopped else thought.stop(reasoning or "", 0):
            yield e
        index = 1
    if content or said.index is not None:
        for e in said.stop(content or "", index):
            yield e
        index += 1
    for block in msg.content:
        if not isinstance(block, ToolUseBlock):
            continue
        yield _event("content_block_start", index=index, content_block=ToolUseBlock(block.id, block.name, {}))
        yield _event("content_block_delta", index=index,
                     delta={"type": "input_json_delta", "partial_json": json.dumps(block.input)})
        yield _event("content_block_stop", index=index)
        index += 1
    # the usage as totals: the prompt's split between computed and cached is known only now
    yield _event("message_delta", delta={"stop_reason": msg.stop_reason, "stop_sequence": msg.stop_sequence},
                 usage=msg.usage)
    yield _event("message_stop")


@anthropic_api
async def count_tokens(request: Request) -> Response:
    st = state_of(request)
    st.owner(request)
    req: CountTokensRequest = decode(await read_body(request, st.config.max_body_bytes), CountTokensRequest)
    st.check_model(req.model)
    messages, _ = chat_messages(req)
    tools, choice = _tools(req)
    plan, options = plan_call(tools, choice), _template_options(messages)

    def token_ids() -> list[int]:
        rendered = st.runtime.plan_template(plan).render(messages)
        return st.runtime.chat_token_ids(rendered, tools=plan.template_tools(), **options)

    ids = await anyio.to_thread.run_sync(token_ids)
    return Response(msgspec.json.encode(CountTokensResponse(len(ids))), media_type="application/json")


ROUTES = [
    Route("/v1/messages", create_message, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]

OPERATIONS = [
    Operation("post", "/v1/messages", "a message (Anthropic's Messages API)", Message, MessagesRequest,
              streams=MessageStreamEvent, errors=(400, 401, 404, 409, 413, 429, 500, 503), error_body=AnthropicError),
    Operation("post", "/v1/messages/count_tokens", "a message's prompt tokens (Anthropic's)", CountTokensResponse,
              CountTokensRequest, errors=(400, 401, 404, 413, 500), error_body=AnthropicError),
]
