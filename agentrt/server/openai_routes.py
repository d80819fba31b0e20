"""`POST /v1/chat/completions` and `POST /v1/completions`, streaming (SSE) and not.

Each handler: decode the body into its schema (a 400 names a bad field), check limits, tokenize
off the event loop, `runtime.submit` (the same call path the in-process API takes), then render
the engine's output as OpenAI's objects. A client that disconnects aborts its calls.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agentrt._call import Call
from agentrt._chat_plan import ChatPlan
from agentrt._errors import AgentrtError
from agentrt.engine.outputs import RequestOutput
from agentrt.server.calls import (
    PendingIds,
    StreamUsage,
    beam_search_call,
    chat_logprobs,
    check_capacity,
    completion_logprobs,
    echoed_logprobs,
    error_event,
    message_dicts,
    new_id,
    output_constraint,
    prepare_openai_chat,
    prompt_logprobs_of,
    sampling_params,
    submit,
    token_text,
    truncated,
    usage_of,
)
from agentrt.server.errors import api, bad_request
from agentrt.server.openapi import Operation
from agentrt.server.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatResponseMessage,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    FunctionCall,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from agentrt.server.sse import DONE, SSEResponse, event, results
from agentrt.server.state import ServerState, read_call


# --- chat -------------------------------------------------------------------------------------
def _answered_tool(messages: list[Any]) -> str | None:
    """The tool a call answers (its last message has role "tool"): by the message's name, else the
    function its tool_call_id answers (calls.note_tool)."""
    if not messages or messages[-1].role != "tool":
        return None
    last = messages[-1]
    name = last.name
    if name is None and last.tool_call_id is not None:
        for m in reversed(messages[:-1]):
            for c in m.tool_calls or ():
                if c.id == last.tool_call_id:
                    name = c.function.name
    return name


def _echoed(req: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the reply starts with the last message's content when it is the assistant's."""
    last = req.messages[-1]
    if not req.echo or last.role != "assistant":
        return ""
    return message_dicts([last])[0]["content"]


@api
async def chat_completions(request: Request) -> Response:
    st, who, req = await read_call(request, ChatCompletionRequest)
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    _check_prompt_logprobs(req)
    prepared = await prepare_openai_chat(st, who, req)
    plan, prompt_ids, params = prepared.plan, prepared.prompt_ids, prepared.params
    if req.use_beam_search:
        call = beam_search_call(st, who, req, prompt_ids, params)
    else:
        call = submit(st, who, prompt_ids, params, "messages", kind="chat", cache_salt=req.cache_salt,
                      tool=_answered_tool(req.messages))
    rid, created, head = new_id("chatcmpl"), int(time.time()), _echoed(req)
    if req.stream:
        usage = StreamUsage(req.stream_options, len(prompt_ids))
        return SSEResponse(_chat_events(st, call, plan, rid, created, req.n, usage, head,
                                        prompt_ids if req.return_token_ids else None, req.return_tokens_as_token_ids),
                           {"X-Program-Id": call.program_id})
    (out,) = await results(request, [call])
    text = token_text(st, req.return_tokens_as_token_ids) if req.logprobs or req.prompt_logprobs is not None else None
    choices = []
    for c in out.outputs:
        reasoning, content, calls = plan.split(c.text)
        if head:
            content = head + (content or "")
        message = ChatResponseMessage(content=content, tool_calls=[
            ToolCall(k.id, FunctionCall(k.name, k.arguments)) for k in calls] or None, reasoning=reasoning,
            reasoning_content=reasoning)
        logprobs = chat_logprobs(text, c.token_ids, c.logprobs, c.top_logprobs) if text is not None else None
        choices.append(ChatChoice(c.index, message, "tool_calls" if calls else c.finish_reason, logprobs,
                                  c.stop_reason, c.token_ids if req.return_token_ids else None))
    body = ChatCompletion(rid, created, call.model or st.model_name, choices, usage_of([out]), program_id=call.program_id,
                          prompt_token_ids=out.prompt_token_ids if req.return_token_ids else None)
    if req.prompt_logprobs is not None:
        body.prompt_logprobs = prompt_logprobs_of(text, out, req.prompt_logprobs)
    return Response(_encode(body), headers={"X-Program-Id": call.program_id}, media_type="application/json")


async def _chat_events(st: ServerState, call: Call, plan: ChatPlan, rid: str, created: int, n: int,
                       usage: StreamUsage, head: str, prompt_ids: list[int] | None,
                       as_ids: bool | None) -> AsyncIterator[bytes]:
    """Content deltas as generated (each choice's first one with `head`, the echoed last message), after
    `reasoning` deltas with a reasoning parser; tool calls (held back from the content) as `tool_calls`
    deltas when their choice ends, which then ends with finish_reason "tool_calls". With `prompt_ids`
    (return_token_ids) the first chunk carries them and each choice's chunks its new token ids. `as_ids`:
    return_tokens_as_token_ids (calls.token_text)."""
    model, text = st.model_of(call), token_text(st, as_ids)
    streamers = [plan.streamer() for _ in range(n)]
    pending = PendingIds(prompt_ids is not None, n)

    def chunk(i: int, delta: ChatDelta, reason: str | None = None, logprobs: ChoiceLogprobs | None = None,
              stop_reason: int | str | None = None) -> bytes:
        choice = ChatChunkChoice(i, delta, reason, logprobs, stop_reason, pending.take(i))
        return event(ChatCompletionChunk(rid, created, model, [choice], usage=usage.now()))

    async with call:
        for i in range(n):  # the prompt's ids (return_token_ids) on the first chunk
            opening = ChatChunkChoice(i, ChatDelta(role="assistant", content=head), token_ids=pending.take(i))
            yield event(ChatCompletionChunk(rid, created, model, [opening], usage=usage.now(),
                                            prompt_token_ids=prompt_ids if i == 0 else None))
        try:
            async for d in call:
                i, streamer = d.index, streamers[d.index]
                usage.add(len(d.new_token_ids))
                pending.add(i, d.new_token_ids)
                reasoning, show = streamer.feed(d.new_text)
                if show or reasoning or (d.new_logprobs and d.new_token_ids):
                    logprobs = chat_logprobs(text, d.new_token_ids, d.new_logprobs, d.new_top_logprobs)
                    yield chunk(i, _delta(reasoning, show), None, logprobs)
                if d.finished:
                    reason = d.finish_reason
                    rest = streamer.finish()
                    if rest.reasoning or rest.content:  # held back: a tag that was not one, text that was no call
                        yield chunk(i, _delta(rest.reasoning, rest.content))
                    if rest.tool_calls:
                        deltas = [ToolCallDelta(k, c.id, "function", FunctionCall(c.name, c.arguments))
                                  for k, c in enumerate(rest.tool_calls)]
                        yield chunk(i, ChatDelta(tool_calls=deltas))
                        reason = "tool_calls"
                    yield chunk(i, ChatDelta(), reason, None, d.stop_reason)
            out = await call.result()
        except AgentrtError as e:
            yield error_event(e)
            yield DONE
            return
        if usage.final:
            yield event(ChatCompletionChunk(rid, created, model, [], usage=usage_of([out])))
        yield DONE


def _delta(reasoning: str, content: str) -> ChatDelta:
    """A chunk's delta: a piece of reasoning (under both of its names) and / or of content."""
    if not reasoning:
        return ChatDelta(content=content)
    return ChatDelta(content=content or None, reasoning=reasoning, reasoning_content=reasoning)


def _check_prompt_logprobs(req: ChatCompletionRequest | CompletionRequest) -> None:
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs are not returned when streaming: set stream=false", "prompt_logprobs")


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
    st, who, req = await read_call(request, CompletionRequest)
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens=0 generates nothing: it is allowed only with echo=true (the prompt scored)",
                          "max_tokens")
    prompts = _prompts(req.prompt)
    if len(prompts) * req.n > st.config.max_n:
        raise bad_request(f"{len(prompts)} prompts x n={req.n} completions is over the server's limit of "
                          f"{st.config.max_n} (--max-n)", "n")
    rt = st.runtime
    tok = rt.tokenizer
    ids = [p if isinstance(p, list) else (await anyio.to_thread.run_sync(lambda p=p: tok(p)["input_ids"])) for p in prompts]
    ids = [truncated(st, i, req.truncate_prompt_tokens) for i in ids]
    constraint, param = output_constraint(req)
    if constraint is not None:
        await anyio.to_thread.run_sync(lambda: rt.compile_constraint(constraint, param))
    _check_prompt_logprobs(req)
    scored = req.echo and req.logprobs is not None  # the echoed prompt comes with its tokens' log-probs
    wanted = [k for k in (req.logprobs if scored else None, req.prompt_logprobs) if k is not None]
    params = [
        sampling_params(
            st, max_tokens=req.max_tokens or 1, prompt_len=len(i), temperature=req.temperature, top_p=req.top_p,
            top_k=req.top_k, n=req.n, stop=req.stop, stop_token_ids=req.stop_token_ids, seed=req.seed, ignore_eos=req.ignore_eos,
            logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0, constraint=constraint, extras=req,
            prompt_logprobs=max(wanted) if wanted else None,
        )
        for i in ids
    ]
    echo = [(p if isinstance(p, str) and req.truncate_prompt_tokens is None else tok.decode(i), i)
            for p, i in zip(prompts, ids)] if req.echo else None  # a truncated prompt echoes what ran
    check_capacity(st)
    calls: list[Call] = []
    try:
        for i, p in zip(ids, params):
            if req.use_beam_search:
                calls.append(beam_search_call(st, who, req, i, p))
                continue
            calls.append(submit(st, who, i, p, "prompt", kind="completion", cache_salt=req.cache_salt, check=False))
    except BaseException:
        for c in calls:
            c.close()
        raise
    rid, created = new_id("cmpl"), int(time.time())
    headers = {"X-Program-Id": calls[0].program_id}
    if req.stream:
        usage = StreamUsage(req.stream_options, sum(len(i) for i in ids))
        return SSEResponse(_completion_events(st, calls, rid, created, req.n, usage, echo, req.max_tokens > 0,
                                              ids if req.return_token_ids else None, req.return_tokens_as_token_ids),
                           headers)
    outs = await results(request, calls)
    text, generated = token_text(st, req.return_tokens_as_token_ids), req.max_tokens > 0
    choices = []
    for k, out in enumerate(outs):
        head, prompt_ids = echo[k] if echo is not None else ("", [])
        for c in out.outputs:  # max_tokens=0 (not generated): the token the engine sampled is not returned
            logprobs = completion_logprobs(text, c.token_ids, c.logprobs, c.top_logprobs, len(head)) if generated else None
            if scored:  # the engine's top lists are as long as the larger of logprobs and prompt_logprobs
                tops = out.prompt_top_logprobs if req.logprobs else None
                tops = None if tops is None else [None if t is None else t[: req.logprobs] for t in tops]
                logprobs = echoed_logprobs(text, prompt_ids, out.prompt_logprobs, tops, logprobs)
            choice = CompletionChoice(k * req.n + c.index, head + (c.text if generated else ""),
                                      c.finish_reason if generated else "length", logprobs,
                                      stop_reason=c.stop_reason if generated else None)
            if req.return_token_ids:
                choice.prompt_token_ids, choice.token_ids = list(out.prompt_token_ids), c.token_ids if generated else []
            if req.prompt_logprobs is not None:
                choice.prompt_logprobs = prompt_logprobs_of(text, out, req.prompt_logprobs)
            choices.append(choice)
    body = Completion(rid, created, st.model_of(calls[0]), choices, _usage(outs, generated), program_id=calls[0].program_id)
    return Response(_encode(body), headers=headers, media_type="application/json")


def _usage(outs: list[RequestOutput], generated: bool) -> Usage:
    usage = usage_of(outs)
    if not generated:  # max_tokens=0: the token the engine had to sample is not returned
        usage.completion_tokens, usage.total_tokens = 0, usage.prompt_tokens
    return usage


async def _completion_events(st: ServerState, calls: list[Call], rid: str, created: int, n: int, usage: StreamUsage,
                             echo: list[tuple[str, list[int]]] | None, generated: bool,
                             prompt_ids: list[list[int]] | None, as_ids: bool | None) -> AsyncIterator[bytes]:
    """Prompts' choices one prompt after another (all of them run in the engine meanwhile). With `echo`
    (per prompt, its text and token ids) each choice's first chunk is its prompt, with the prompt's
    log-probs when they were asked; without `generated` (max_tokens=0) nothing follows but the finish.
    With `prompt_ids` (return_token_ids) each choice's first chunk carries its prompt's token ids and
    every chunk the tokens since the choice's last one. `as_ids`: return_tokens_as_token_ids."""
    model, text = st.model_of(calls[0]), token_text(st, as_ids)
    outs: list[RequestOutput] = []

    def chunk(k: int, i: int, piece: str, reason: str | None = None, logprobs: CompletionLogprobs | None = None,
              stop_reason: int | str | None = None) -> bytes:
        choice = CompletionChoice(k * n + i, piece, reason, logprobs, stop_reason=stop_reason,
                                  token_ids=pending.take(i))
        if prompt_ids is not None and not started[i]:
            choice.prompt_token_ids = prompt_ids[k]
        started[i] = True
        return event(Completion(rid, created, model, [choice], usage.now()))

    try:
        for k, call in enumerate(calls):
            async with call:
                offsets, started = [0] * n, [False] * n
                echoed = [echo is None] * n
                pending = PendingIds(prompt_ids is not None, n)
                async for d in call:
                    if not echoed[d.index]:
                        head, echo_ids = echo[k]
                        logprobs = echoed_logprobs(text, echo_ids, d.prompt_logprobs, d.prompt_top_logprobs, None)
                        yield chunk(k, d.index, head, None, logprobs)
                        echoed[d.index], offsets[d.index] = True, len(head)
                    if not generated:
                        if d.finished:
                            yield chunk(k, d.index, "", "length")
                        continue
                    usage.add(len(d.new_token_ids))
                    pending.add(d.index, d.new_token_ids)
                    lps = d.new_logprobs
                    if d.new_text or d.finished or (lps and d.new_token_ids):
                        logprobs = completion_logprobs(text, d.new_token_ids, lps, d.new_top_logprobs,
                                                       offsets[d.index])
                        offsets[d.index] += len(d.new_text)
                        yield chunk(k, d.index, d.new_text, d.finish_reason if d.finished else None, logprobs,
                                    d.stop_reason)
                outs.append(await call.result())
    except AgentrtError as e:
        yield error_event(e)
        yield DONE
        return
    finally:
        for c in calls:
            c.close()
    if usage.final:
        yield event(Completion(rid, created, model, [], _usage(outs, generated)))
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
