"""`POST /v1/chat/completions` and `POST /v1/completions`, streaming (SSE) and not.

Each handler: decode the body into its schema (a 400 names a bad field), check limits, tokenize
off the event loop, `runtime.submit` (the same call path the in-process API takes), then render
the engine's output as OpenAI's objects. A client that disconnects aborts its calls.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agentrt._call import Call
from agentrt._errors import AgentrtError, InvalidCallError
from agentrt.server.app import ServerState, read_body, state_of
from agentrt.server.errors import api, bad_request, error_body, to_api_error
from agentrt.server.openapi import Operation
from agentrt.server.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessage,
    ChatResponseMessage,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    TokenLogprob,
    TopLogprob,
    ProgramId,
    Usage,
    decode,
)
from agentrt.server.sse import DONE, SSEResponse, event, until_disconnect
from engine import SamplingParams
from engine.outputs import RequestOutput

TopList = list[tuple[int, float]]


# --- shared -----------------------------------------------------------------------------------
def program_keys(request: Request, program_id: str | None, thread_id: str | None) -> tuple[str | None, str | None]:
    """The call's program and thread: `X-Program-Id` / `X-Thread-Id` headers or the body fields."""
    out = []
    for header, value, name in (("x-program-id", program_id, "program_id"), ("x-thread-id", thread_id, "thread_id")):
        h = request.headers.get(header)
        if h is not None:
            try:
                h = msgspec.convert(h, ProgramId)
            except msgspec.ValidationError:
                raise bad_request(f"header {header} {h!r} is not a valid id (1-128 of A-Z a-z 0-9 . _ : -)", name) from None
            if value is not None and value != h:
                raise bad_request(f"{name} {value!r} in the body differs from the {header} header {h!r}", name)
        out.append(h if h is not None else value)
    return out[0], out[1]


def sampling_params(
    st: ServerState, *, max_tokens: int | None, prompt_len: int, temperature: float | None, top_p: float | None,
    top_k: int | None, n: int, stop: str | list[str] | None, stop_token_ids: list[int] | None, seed: int | None,
    ignore_eos: bool, logprobs: bool, top_logprobs: int,
) -> SamplingParams:
    if n > st.config.max_n:
        raise bad_request(f"n={n} is over the server's limit of {st.config.max_n} (--max-n)", "n")
    if max_tokens is not None and max_tokens > st.max_tokens_limit:
        raise bad_request(f"max_tokens={max_tokens} is over the limit of {st.max_tokens_limit}", "max_tokens")
    if max_tokens is None:
        max_tokens = max(1, min(st.max_tokens_limit, st.max_model_len - prompt_len))
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p, top_k=-1 if top_k is None else top_k, n=n,
            stop=[] if stop is None else stop, stop_token_ids=stop_token_ids or [], seed=seed, ignore_eos=ignore_eos, logprobs=logprobs,
            top_logprobs=top_logprobs,
        )
    except (TypeError, ValueError) as e:
        raise bad_request(str(e), _param_of(str(e))) from None


_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)")


def _param_of(message: str, default: str | None = None) -> str | None:
    """The request field an engine error message names (`SamplingParams.stop ...` -> "stop"), else
    `default` (what the prompt came in: "messages" or "prompt")."""
    m = _SAMPLING_FIELD.search(message)
    return m.group(1) if m else default


def submit(st: ServerState, ids: list[int], params: SamplingParams, prompt_param: str, **kw: Any) -> Call:
    """`runtime.submit`; input the engine refuses is a 400 naming the field."""
    try:
        return st.runtime.submit(ids, params, **kw)
    except InvalidCallError as e:
        raise bad_request(str(e), _param_of(str(e), prompt_param)) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class TokenText:
    """Token id -> its text, cached (logprob rendering)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, tok: int) -> str:
        s = self._cache.get(tok)
        if s is None:
            s = self._cache[tok] = self.tokenizer.decode([tok])
        return s


def _token_text(st: ServerState) -> TokenText:
    tt = getattr(st, "_token_text", None)
    if tt is None:
        tt = TokenText(st.runtime.tokenizer)
        st._token_text = tt  # type: ignore[attr-defined]
    return tt


def chat_logprobs(text: TokenText, ids: list[int], lps: list[float] | None, tops: list[TopList] | None) -> ChoiceLogprobs | None:
    if lps is None:
        return None
    content = []
    for i, (tok, lp) in enumerate(zip(ids, lps)):
        t = text(tok)
        top = [TopLogprob(text(a), b, list(text(a).encode())) for a, b in (tops[i] if tops else [])]
        content.append(TokenLogprob(t, lp, list(t.encode()), top))
    return ChoiceLogprobs(content)


def completion_logprobs(text: TokenText, ids: list[int], lps: list[float] | None, tops: list[TopList] | None,
                        offset: int = 0) -> CompletionLogprobs | None:
    if lps is None:
        return None
    tokens = [text(t) for t in ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    top = [{text(a): b for a, b in tl} for tl in tops] if tops is not None else None
    return CompletionLogprobs(tokens, list(lps), top, offsets)


def usage_of(outs: list[RequestOutput]) -> Usage:
    prompt = sum(o.num_prompt_tokens for o in outs)
    completion = sum(o.num_output_tokens for o in outs)
    return Usage(prompt, completion, prompt + completion)


async def _results(request: Request, calls: list[Call]) -> list[RequestOutput]:
    async def run() -> list[RequestOutput]:
        return [await c.result() for c in calls]

    try:
        return await until_disconnect(request, run)
    finally:
        for c in calls:
            c.close()


def _error_event(e: BaseException) -> bytes:
    return b"data: " + error_body(to_api_error(e)) + b"\n\n"


# --- chat -------------------------------------------------------------------------------------
def _message_dict(m: ChatMessage) -> dict[str, Any]:
    content = m.content
    if isinstance(content, list):
        bad = [p.type for p in content if p.type != "text"]
        if bad:
            raise bad_request(f"message content part of type {bad[0]!r} is not supported (only 'text')", "messages")
        content = "".join(p.text or "" for p in content)
    role = "system" if m.role == "developer" else m.role
    return {"role": role, "content": content or ""}


@api
async def chat_completions(request: Request) -> Response:
    st = state_of(request)
    owner = st.owner(request)
    req: ChatCompletionRequest = decode(await read_body(request, st.config.max_body_bytes), ChatCompletionRequest)
    st.check_model(req.model)
    pid, tid = program_keys(request, req.program_id, req.thread_id)
    messages = [_message_dict(m) for m in req.messages]
    rt = st.runtime
    ids = await anyio.to_thread.run_sync(rt.chat_token_ids, messages, pid)
    params = sampling_params(
        st, max_tokens=req.max_completion_tokens or req.max_tokens, prompt_len=len(ids), temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, n=req.n, stop=req.stop, stop_token_ids=req.stop_token_ids, seed=req.seed, ignore_eos=req.ignore_eos,
        logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0,
    )
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    st.check_capacity()
    call = submit(st, ids, params, "messages", program_id=pid, thread_id=tid, owner=owner, cache_salt=owner, kind="chat")
    rid, created = new_id("chatcmpl"), int(time.time())
    if req.stream:
        usage = req.stream_options is not None and req.stream_options.include_usage
        return SSEResponse(_chat_events(st, call, rid, created, req.n, usage), {"X-Program-Id": call.program_id})
    (out,) = await _results(request, [call])
    text = _token_text(st)
    choices = [
        ChatChoice(c.index, ChatResponseMessage(content=c.text), c.finish_reason,
                   chat_logprobs(text, c.token_ids, c.logprobs, getattr(c, "top_logprobs", None)))
        for c in out.outputs
    ]
    body = ChatCompletion(rid, created, st.model_name, choices, usage_of([out]), program_id=call.program_id)
    return Response(_encode(body), headers={"X-Program-Id": call.program_id}, media_type="application/json")


async def _chat_events(st: ServerState, call: Call, rid: str, created: int, n: int, include_usage: bool) -> AsyncIterator[bytes]:
    model, text = st.model_name, _token_text(st)

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        return event(ChatCompletionChunk(rid, created, model, choices, usage=usage))

    async with call:
        for i in range(n):
            yield chunk([ChatChunkChoice(i, ChatDelta(role="assistant", content=""))])
        try:
            async for d in call:
                lps = getattr(d, "new_logprobs", None)
                if d.new_text or (lps and d.new_token_ids):
                    logprobs = chat_logprobs(text, d.new_token_ids, lps, getattr(d, "new_top_logprobs", None))
                    yield chunk([ChatChunkChoice(d.index, ChatDelta(content=d.new_text), None, logprobs)])
                if d.finished:
                    yield chunk([ChatChunkChoice(d.index, ChatDelta(), d.finish_reason)])
            out = await call.result()
        except AgentrtError as e:
            yield _error_event(e)
            yield DONE
            return
        if include_usage:
            yield chunk([], usage_of([out]))
        yield DONE


# --- completions ----------------------------------------------------------------------------
def _prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return list(prompt)
    raise bad_request("prompt must be a string, a list of strings, a list of token ids, or a list of those lists",
                      "prompt")


@api
async def completions(request: Request) -> Response:
    st = state_of(request)
    owner = st.owner(request)
    req: CompletionRequest = decode(await read_body(request, st.config.max_body_bytes), CompletionRequest)
    st.check_model(req.model)
    if req.echo:
        raise bad_request("echo is not supported", "echo")
    pid, tid = program_keys(request, req.program_id, req.thread_id)
    prompts = _prompts(req.prompt)
    if len(prompts) * req.n > st.config.max_n:
        raise bad_request(f"{len(prompts)} prompts x n={req.n} completions is over the server's limit of "
                          f"{st.config.max_n} (--max-n)", "n")
    rt = st.runtime
    tok = rt.tokenizer
    ids = [p if isinstance(p, list) else (await anyio.to_thread.run_sync(lambda p=p: tok(p)["input_ids"])) for p in prompts]
    params = [
        sampling_params(
            st, max_tokens=req.max_tokens, prompt_len=len(i), temperature=req.temperature, top_p=req.top_p,
            top_k=req.top_k, n=req.n, stop=req.stop, stop_token_ids=req.stop_token_ids, seed=req.seed, ignore_eos=req.ignore_eos,
            logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0,
        )
        for i in ids
    ]
    st.check_capacity()
    calls: list[Call] = []
    try:
        for i, p in zip(ids, params):
            calls.append(submit(st, i, p, "prompt", program_id=pid, thread_id=tid, owner=owner, cache_salt=owner,
                                kind="completion"))
    except BaseException:
        for c in calls:
            c.close()
        raise
    rid, created = new_id("cmpl"), int(time.time())
    headers = {"X-Program-Id": calls[0].program_id}
    if req.stream:
        usage = req.stream_options is not None and req.stream_options.include_usage
        return SSEResponse(_completion_events(st, calls, rid, created, req.n, usage), headers)
    outs = await _results(request, calls)
    text = _token_text(st)
    choices = [
        CompletionChoice(k * req.n + c.index, c.text, c.finish_reason,
                         completion_logprobs(text, c.token_ids, c.logprobs, getattr(c, "top_logprobs", None)))
        for k, out in enumerate(outs) for c in out.outputs
    ]
    body = Completion(rid, created, st.model_name, choices, usage_of(outs), program_id=calls[0].program_id)
    return Response(_encode(body), headers=headers, media_type="application/json")


async def _completion_events(st: ServerState, calls: list[Call], rid: str, created: int, n: int,
                             include_usage: bool) -> AsyncIterator[bytes]:
    """Prompts' choices one prompt after another (all of them run in the engine meanwhile)."""
    model, text = st.model_name, _token_text(st)
    outs: list[RequestOutput] = []
    try:
        for k, call in enumerate(calls):
            async with call:
                offsets = [0] * n
                async for d in call:
                    lps = getattr(d, "new_logprobs", None)
                    if d.new_text or d.finished or (lps and d.new_token_ids):
                        logprobs = completion_logprobs(text, d.new_token_ids, lps, getattr(d, "new_top_logprobs", None),
                                                       offsets[d.index])
                        offsets[d.index] += len(d.new_text)
                        choice = CompletionChoice(k * n + d.index, d.new_text, d.finish_reason if d.finished else None,
                                                  logprobs)
                        yield event(Completion(rid, created, model, [choice]))
                outs.append(await call.result())
    except AgentrtError as e:
        yield _error_event(e)
        yield DONE
        return
    finally:
        for c in calls:
            c.close()
    if include_usage:
        yield event(Completion(rid, created, model, [], usage_of(outs)))
    yield DONE


def _encode(obj: object) -> bytes:
    return msgspec.json.encode(obj)


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
]

OPERATIONS = [
    Operation("post", "/v1/chat/completions", "chat completion (OpenAI-compatible)", ChatCompletion,
              ChatCompletionRequest, streams=ChatCompletionChunk, errors=(400, 401, 404, 409, 413, 429, 500, 503)),
    Operation("post", "/v1/completions", "text completion (OpenAI-compatible)", Completion, CompletionRequest,
              streams=Completion, errors=(400, 401, 404, 409, 413, 429, 500, 503)),
]
