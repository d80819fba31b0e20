"""`POST /v1/embeddings`: OpenAI's embeddings API (and vLLM's extras), keyed by program id like every call;
vLLM's `/score` and `/rerank` on the same embeddings (cosine similarity, as vLLM scores with an embedding model).

Each input is one pooling call of the engine (engine.pooling): its prompt is computed, its final
hidden states pooled (the server's `--pooling`, by default what the checkpoint declares, else the
last token's), cut to `dimensions` and L2-normalized, with no token sampled. The calls belong to the
program named by `X-Program-Id` (or `program_id`), so an agent's retrieval is scheduled and accounted
with its other calls; without one, each input is a one-call program.
"""

from __future__ import annotations

import base64
import time
from typing import Annotated, Any, Literal, NamedTuple

import anyio
import msgspec
import numpy as np
from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agentrt._call import Call
from agentrt._embed import embed_inputs
from agentrt._errors import InvalidCallError
from agentrt.engine.pooling import PoolingParams
from agentrt.engine.sampling_params import SamplingParams
from agentrt.server.calls import check_capacity, new_id, submit, truncated
from agentrt.server.errors import api, bad_request
from agentrt.server.openapi import Operation
from agentrt.server.schemas import Priority, ProgramId, TruncatePromptTokens
from agentrt.server.sse import results
from agentrt.server.state import Caller, ServerState, read_call


class PoolingCallFields(Struct, kw_only=True):
    """What every embedding-based request takes besides its inputs."""

    model: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None  # keep the last k tokens (-1: all the context takes)
    priority: Priority = 0
    program_id: ProgramId | None = None
    thread_id: ProgramId | None = None


class EmbeddingRequest(PoolingCallFields, kw_only=True):
    input: Any  # a string, a list of strings, a list of token ids, or a list of those lists
    encoding_format: Literal["float", "base64"] = "float"  # base64: the vector's float32 bytes, little-endian
    dimensions: Annotated[int, Meta(ge=1)] | None = None  # keep the first D values (then normalize)
    user: str | None = None
    # vLLM's extras
    normalize: bool = True  # scale to unit L2 norm
    add_special_tokens: bool = True  # the tokenizer's special tokens (e.g. BOS) around text inputs


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


def pooling_inputs(value: Any) -> list[str | list[int]]:
    try:
        return embed_inputs(value)[1]  # the rule agentrt.embed checks
    except InvalidCallError:
        raise bad_request("input must be a non-empty string, a list of strings, a non-empty list of token ids, or "
                          "a list of such lists", "input") from None


class _Pooled(NamedTuple):
    vectors: list[list[float]]
    prompt_tokens: int
    program_id: str


class PoolingCall(NamedTuple):
    st: ServerState
    who: Caller  # its key's owner, the LoRA adapter its model names, its program
    req: Any  # a PoolingCallFields request

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter the request names as its model (None: the base model)."""
        return self.who.model


async def begin_pooling(request: Request, type_: type) -> PoolingCall:
    """What every embedding-based route starts with: the key checked (401 before anything else), the body
    decoded into `type_`, the model and the program keys."""
    return PoolingCall(*await read_call(request, type_))


async def run_pooling(request: Request, b: PoolingCall, inputs: list[str | list[int]], param: str, *,
                      normalize: bool = True, dimensions: int | None = None, add_special_tokens: bool = True,
                      method: str | None = None) -> _Pooled:
    """The inputs' embeddings, each one pooling call of the program; a 400 naming `param` for bad input.
    `method`: the pooling (engine.pooling); None: the server's."""
    st, truncate = b.st, b.req.truncate_prompt_tokens
    if len(inputs) > st.config.max_embedding_inputs:
        raise bad_request(f"{len(inputs)} inputs is over the server's limit of {st.config.max_embedding_inputs} "
                          "(--max-embedding-inputs)", param)
    tok = st.runtime.tokenizer
    ids = []
    for x in inputs:
        if isinstance(x, str):
            x = await anyio.to_thread.run_sync(lambda x=x: tok(x, add_special_tokens=add_special_tokens)["input_ids"])
        x = truncated(st, x, truncate)  # the generation routes' rule (engine.sampling_params.truncate_prompt)
        if not x:
            raise bad_request("an input has no tokens", param)
        ids.append(x)
    params = SamplingParams(max_tokens=1, priority=b.req.priority,
                            pooling=PoolingParams(method or st.pooling_method, normalize, dimensions))
    check_capacity(st)
    calls: list[Call] = []
    try:
        for x in ids:
            calls.append(submit(st, b.who, x, params, param, kind="embedding", check=False))
    except BaseException:
        for c in calls:
            c.close()
        raise
    outs = await results(request, calls)
    return _Pooled([o.embedding for o in outs], sum(o.num_prompt_tokens for o in outs), calls[0].program_id)


def pooling_response(body: object, program_id: str) -> Response:
    return Response(msgspec.json.encode(body), headers={"X-Program-Id": program_id}, media_type="application/json")


@api
async def create_embeddings(request: Request) -> Response:
    b = await begin_pooling(request, EmbeddingRequest)
    st, req = b.st, b.req
    inputs = pooling_inputs(req.input)
    hidden = st.runtime.engine_info.hidden_size
    if req.dimensions is not None and req.dimensions > hidden:
        raise bad_request(f"dimensions={req.dimensions} is over the model's hidden size {hidden}", "dimensions")
    got = await run_pooling(request, b, inputs, "input", normalize=req.normalize, dimensions=req.dimensions,
                      add_special_tokens=req.add_special_tokens)
    data = [Embedding(_encode(v, req.encoding_format), i) for i, v in enumerate(got.vectors)]
    usage = EmbeddingUsage(got.prompt_tokens, got.prompt_tokens)
    body = EmbeddingList(new_id("embd"), int(time.time()), b.adapter or st.model_name, data, usage,
                         program_id=got.program_id)
    return pooling_response(body, got.program_id)


# --- vLLM's /score and /rerank: cosine similarity of embeddings -------------------------------
class ScoreRequest(PoolingCallFields, kw_only=True):
    text_1: str | list[str]  # one text scored against each of text_2, or a list paired with text_2's
    text_2: str | list[str]


class ScoreData(Struct):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(Struct):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage
    object: str = "list"


class RerankRequest(PoolingCallFields, kw_only=True):
    query: str
    documents: list[str]
    top_n: Annotated[int, Meta(ge=0)] = 0  # the best N (0: all)
    return_documents: bool = True


class RerankDocument(Struct):
    text: str


class RerankResult(Struct):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(Struct):
    total_tokens: int


class RerankResponse(Struct):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


def _texts(value: str | list[str], param: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not texts or any(not t for t in texts):
        raise bad_request(f"{param} must be a non-empty string or a non-empty list of non-empty strings", param)
    return texts


def _cosines(query: list[list[float]], docs: list[list[float]]) -> list[float]:
    """Cosine similarity of each pair (query[i] or the one query, docs[i]); the vectors are unit length."""
    q, d = np.asarray(query, dtype=np.float64), np.asarray(docs, dtype=np.float64)
    return [float(x) for x in (np.broadcast_to(q, d.shape) * d).sum(axis=1)]


@api
async def score(request: Request) -> Response:
    b = await begin_pooling(request, ScoreRequest)
    st, req = b.st, b.req
    first, second = _texts(req.text_1, "text_1"), _texts(req.text_2, "text_2")
    if len(first) != 1 and len(first) != len(second):
        raise bad_request(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many "
                          "as text_2", "text_1")
    got = await run_pooling(request, b, [*first, *second], "text_2")
    scores = _cosines(got.vectors[: len(first)], got.vectors[len(first):])
    data = [ScoreData(i, s) for i, s in enumerate(scores)]
    body = ScoreResponse(new_id("score"), int(time.time()), b.adapter or st.model_name, data,
                         EmbeddingUsage(got.prompt_tokens, got.prompt_tokens))
    return pooling_response(body, got.program_id)


@api
async def rerank(request: Request) -> Response:
    b = await begin_pooling(request, RerankRequest)
    st, req = b.st, b.req
    query, docs = _texts(req.query, "query"), _texts(req.documents, "documents")
    got = await run_pooling(request, b, [*query, *docs], "documents")
    scores = _cosines(got.vectors[:1], got.vectors[1:])
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[: req.top_n or None]
    out = [RerankResult(i, scores[i], RerankDocument(docs[i]) if req.return_documents else None) for i in order]
    body = RerankResponse(new_id("rerank"), b.adapter or st.model_name, out, RerankUsage(got.prompt_tokens))
    return pooling_response(body, got.program_id)


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":  # what OpenAI's SDKs decode (numpy.frombuffer(..., dtype="float32"))
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


ROUTES = [
    Route("/v1/embeddings", create_embeddings, methods=["POST"]),
    *(Route(path, score, methods=["POST"]) for path in ("/score", "/v1/score")),
    *(Route(path, rerank, methods=["POST"]) for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
]

_ERRORS = (400, 401, 404, 413, 429, 500, 503)
OPERATIONS = [
    Operation("post", "/v1/embeddings", "embeddings (OpenAI-compatible)", EmbeddingList, EmbeddingRequest,
              errors=_ERRORS),
    # documented once each (operation ids are unique); /score, /rerank and /v2/rerank answer the same
    Operation("post", "/v1/score", "cosine similarity of text pairs' embeddings (vLLM's; also at /score)",
              ScoreResponse, ScoreRequest, errors=_ERRORS),
    Operation("post", "/v1/rerank", "documents ordered by their embeddings' similarity to a query (vLLM's, Jina / "
              "Cohere-compatible; also at /rerank and /v2/rerank)", RerankResponse, RerankRequest, errors=_ERRORS),
]
