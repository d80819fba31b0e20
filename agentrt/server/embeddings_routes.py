"""`POST /v1/embeddings`: OpenAI's embeddings API (and vLLM's extras), keyed by program id like every call.

Each input is one pooling call of the engine (engine.pooling): its prompt is computed, its final
hidden states pooled (the server's `--pooling`, by default what the checkpoint declares, else the
last token's), cut to `dimensions` and L2-normalized, with no token sampled. The calls belong to the
program named by `X-Program-Id` (or `program_id`), so an agent's retrieval is scheduled and accounted
with its other calls; without one, each input is a one-call program.
"""

from __future__ import annotations

import base64
import time
from typing import Annotated, Any, Literal

import anyio
import msgspec
import numpy as np
from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agentrt._call import Call
from agentrt.server.app import read_body, state_of
from agentrt.server.calls import new_id, program_keys, program_name, results, submit
from agentrt.server.errors import api, bad_request
from agentrt.server.openapi import Operation
from agentrt.server.schemas import Priority, ProgramId, decode
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams


class EmbeddingRequest(Struct):
    input: Any  # a string, a list of strings, a list of token ids, or a list of those lists
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"  # base64: the vector's float32 bytes, little-endian
    dimensions: Annotated[int, Meta(ge=1)] | None = None  # keep the first D values (then normalize)
    user: str | None = None
    # vLLM's extras
    normalize: bool = True  # scale to unit L2 norm
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None  # keep the last k tokens (-1: the context)
    add_special_tokens: bool = True  # the tokenizer's special tokens (e.g. BOS) around text inputs
    priority: Priority = 0
    program_id: ProgramId | None = None
    thread_id: ProgramId | None = None


class Embedding(Struct):
    embedding: list[float] | str
    index: int
    object: str = "embedding"


class EmbeddingUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Struct):
    id: str
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage
    object: str = "list"
    program_id: str | None = None


def _inputs(value: Any) -> list[str | list[int]]:
    def token_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(value, str):
        return [value]
    if token_ids(value):
        return [value]
    if isinstance(value, list) and value and (all(isinstance(x, str) for x in value) or all(map(token_ids, value))):
        return list(value)
    raise bad_request("input must be a non-empty string, a list of strings, a non-empty list of token ids, or a "
                      "list of such lists", "input")


@api
async def create_embeddings(request: Request) -> Response:
    st = state_of(request)
    owner = st.owner(request)
    req: EmbeddingRequest = decode(await read_body(request, st.config.max_body_bytes), EmbeddingRequest)
    st.check_model(req.model)
    pid, tid = program_keys(request, req.program_id, req.thread_id)
    inputs = _inputs(req.input)
    if len(inputs) > st.config.max_embedding_inputs:
        raise bad_request(f"{len(inputs)} inputs is over the server's limit of {st.config.max_embedding_inputs} "
                          "(--max-embedding-inputs)", "input")
    hidden = st.runtime._engine().core.model.args.hidden_size
    if req.dimensions is not None and req.dimensions > hidden:
        raise bad_request(f"dimensions={req.dimensions} is over the model's hidden size {hidden}", "dimensions")
    tok = st.runtime.tokenizer
    ids = []
    for x in inputs:
        if isinstance(x, str):
            x = await anyio.to_thread.run_sync(lambda x=x: tok(x, add_special_tokens=req.add_special_tokens)["input_ids"])
        if req.truncate_prompt_tokens is not None:
            keep = st.max_model_len if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
            x = x[len(x) - keep:] if 0 < keep < len(x) else x
        if not x:
            raise bad_request("an input has no tokens", "input")
        ids.append(x)
    params = SamplingParams(max_tokens=1, priority=req.priority,
                            pooling=PoolingParams(st.pooling_method, req.normalize, req.dimensions))
    st.check_capacity()
    calls: list[Call] = []
    try:
        for x in ids:
            calls.append(submit(st, x, params, "input", program_id=pid, thread_id=tid, owner=owner, cache_salt=owner,
                                kind="embedding", name=program_name(request)))
    except BaseException:
        for c in calls:
            c.close()
        raise
    outs = await results(request, calls)
    data = [Embedding(_encode(o.embedding, req.encoding_format), i) for i, o in enumerate(outs)]
    tokens = sum(o.num_prompt_tokens for o in outs)
    body = EmbeddingList(new_id("embd"), int(time.time()), st.model_name, data, EmbeddingUsage(tokens, tokens),
                         program_id=calls[0].program_id)
    return Response(msgspec.json.encode(body), headers={"X-Program-Id": calls[0].program_id},
                    media_type="application/json")


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":  # what OpenAI's SDKs decode (numpy.frombuffer(..., dtype="float32"))
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


ROUTES = [Route("/v1/embeddings", create_embeddings, methods=["POST"])]

OPERATIONS = [
    Operation("post", "/v1/embeddings", "embeddings (OpenAI-compatible)", EmbeddingList, EmbeddingRequest,
              errors=(400, 401, 404, 413, 429, 500, 503)),
]
