"""vLLM's `POST /classify` (also `/v1/classify`): a sequence classifier's class probabilities per input.

The served checkpoint is a *ForSequenceClassification one (engine: its `score` head). Each input is one
pooling call of the program, as an embedding is (embeddings_routes): its last token's final hidden state,
which the head turns into class logits, then a softmax (`LLM.classify`'s computation)."""

from __future__ import annotations

import time
from typing import Any

from msgspec import Struct
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agentrt.server.calls import new_id
from agentrt.server.embeddings_routes import (
    EmbeddingUsage,
    PoolingCallFields,
    begin_pooling,
    pooling_inputs,
    pooling_response,
    run_pooling,
)
from agentrt.server.errors import api, bad_request
from agentrt.server.openapi import Operation


class ClassificationRequest(PoolingCallFields, kw_only=True):
    input: Any  # a string, a list of strings, a list of token ids, or a list of those lists
    add_special_tokens: bool = True  # the tokenizer's special tokens (e.g. BOS) around text inputs
    user: str | None = None


class ClassificationData(Struct):
    index: int
    label: str  # the most likely class (the checkpoint's id2label)
    probs: list[float]  # per class, in the checkpoint's order
    num_classes: int
    object: str = "classification"


class ClassificationResponse(Struct):
    id: str
    created: int
    model: str
    data: list[ClassificationData]
    usage: EmbeddingUsage
    object: str = "list"


@api
async def classify(request: Request) -> Response:
    b = await begin_pooling(request, ClassificationRequest)
    st, req = b.st, b.req
    if not st.runtime.engine_info.has_score_head:
        raise bad_request(f"the served model {st.model_name!r} has no classification head: /classify needs a "
                          "*ForSequenceClassification checkpoint", "model")
    got = await run_pooling(request, b, pooling_inputs(req.input), "input", normalize=False, method="last",
                      add_special_tokens=req.add_special_tokens)
    outs = await st.runtime.classifications(got.vectors)
    data = [ClassificationData(i, o.label, o.probs, o.num_classes) for i, o in enumerate(outs)]
    body = ClassificationResponse(new_id("classify"), int(time.time()), b.adapter or st.model_name, data,
                                  EmbeddingUsage(got.prompt_tokens, got.prompt_tokens))
    return pooling_response(body, got.program_id)


ROUTES = [Route(path, classify, methods=["POST"]) for path in ("/classify", "/v1/classify")]

OPERATIONS = [
    Operation("post", "/classify", "class probabilities of a sequence classifier (vLLM's; also at /v1/classify)",
              ClassificationResponse, ClassificationRequest, errors=(400, 401, 404, 413, 429, 500, 503)),
]
