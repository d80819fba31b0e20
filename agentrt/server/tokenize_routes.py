"""What a vLLM client finds besides the completions: `GET /v1/models/{model}` (OpenAI's retrieve),
`POST /tokenize` and `POST /detokenize` (vLLM's: token ids of a prompt or of a conversation exactly as
the completion endpoints would send it to the engine, and text of token ids), `GET /version`, and
`POST /reset_prefix_cache` (vLLM's: the engine forgets its cached prefixes no call holds, so later calls
compute them again: benchmarks measure cold prompts with it)."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agentrt._chat_plan import plan_call
from agentrt.server.bodies import VERSION, json_response, read_body
from agentrt.server.calls import message_dicts, request_template
from agentrt.server.errors import api, bad_request
from agentrt.server.openapi import Operation
from agentrt.server.schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    Model,
    PrefixCacheReset,
    TokenizeRequest,
    TokenizeResponse,
    Version,
    decode,
)
from agentrt.server.state import ServerState, state_of


@api
async def retrieve_model(request: Request) -> Response:
    st = state_of(request)
    st.owner(request)
    name = st.check_model(request.path_params["model"]) or st.model_name
    return json_response(next(card for card in st.model_cards() if card.id == name))


@api
async def tokenize(request: Request) -> Response:
    st = state_of(request)
    st.owner(request)
    req: TokenizeRequest = decode(await read_body(request, st.config.max_body_bytes), TokenizeRequest)
    st.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give either prompt (text) or messages (a conversation)",
                          "prompt" if req.prompt is None else "messages")
    if req.tools is not None and req.messages is None:
        raise bad_request("tools go with messages", "tools")
    tok = st.runtime.tokenizer
    if req.prompt is not None:
        prompt = req.prompt
        ids = await anyio.to_thread.run_sync(lambda: tok(prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
    else:
        ids = await anyio.to_thread.run_sync(_chat_ids, st, req)
    strs = [tok.decode([t]) for t in ids] if req.return_token_strs else None
    return json_response(TokenizeResponse(len(ids), st.max_model_len, ids, strs))


def _chat_ids(st: ServerState, req: TokenizeRequest) -> list[int]:
    """The conversation's token ids as /v1/chat/completions builds them (tools described the same way)."""
    assert req.messages is not None
    tools: Any = [msgspec.to_builtins(t) for t in req.tools] if req.tools else None
    template = request_template(st, req.chat_template)
    plan = st.runtime.plan_template(plan_call(tools), template)
    return st.runtime.chat_token_ids(plan.render(message_dicts(req.messages)), tools=plan.template_tools(),
                                     add_generation_prompt=req.add_generation_prompt,
                                     continue_final_message=req.continue_final_message,
                                     chat_template_kwargs=req.chat_template_kwargs, chat_template=template)


@api
async def detokenize(request: Request) -> Response:
    st = state_of(request)
    st.owner(request)
    req: DetokenizeRequest = decode(await read_body(request, st.config.max_body_bytes), DetokenizeRequest)
    st.check_model(req.model)
    bad = [(i, t) for i, t in enumerate(req.tokens) if t >= st.vocab_size]
    if bad:
        i, t = bad[0]
        raise bad_request(f"token id {t} at tokens[{i}] is out of the vocabulary [0, {st.vocab_size})", f"tokens[{i}]")
    tokens = req.tokens
    text = await anyio.to_thread.run_sync(lambda: st.runtime.tokenizer.decode(tokens))
    return json_response(DetokenizeResponse(text))


@api
async def reset_prefix_cache(request: Request) -> Response:
    st = state_of(request)
    st.owner(request)
    return json_response(PrefixCacheReset(await st.runtime.reset_prefix_cache()))


async def version(request: Request) -> Response:
    return json_response(Version(VERSION))


ROUTES = [
    Route("/v1/models/{model}", retrieve_model, methods=["GET"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/version", version, methods=["GET"]),
    Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
]

OPERATIONS = [
    Operation("get", "/v1/models/{model}", "one model (OpenAI's retrieve)", Model, errors=(401, 404, 500)),
    Operation("post", "/tokenize", "token ids of a prompt or a conversation (vLLM)", TokenizeResponse, TokenizeRequest,
              errors=(400, 401, 404, 413, 500)),
    Operation("post", "/detokenize", "text of token ids (vLLM)", DetokenizeResponse, DetokenizeRequest,
              errors=(400, 401, 404, 413, 500)),
    Operation("get", "/version", "agentrt's version", Version, errors=(), auth=False),
    Operation("post", "/reset_prefix_cache", "forget the cached prefixes no call holds (vLLM)", PrefixCacheReset,
              errors=(401, 500)),
]
