"""vLLM's runtime LoRA updating: `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` serves an adapter
under a new model name from then on, `POST /v1/unload_lora_adapter {"lora_name"}` stops serving it (calls
already running with it finish with it). Off unless the server runs with `--allow-runtime-lora-updating`
(or vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`): then both answer 404 saying so. Adapters given at
start-up (`--lora-modules`) and loaded here are listed by /v1/models; a request names one as its model.
"""

from __future__ import annotations

from msgspec import Struct
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from agentrt.server.bodies import read_body
from agentrt.server.errors import APIError, api, bad_request
from agentrt.server.openapi import Operation
from agentrt.server.schemas import decode
from agentrt.server.state import ServerState, state_of


class LoadLoRAAdapterRequest(Struct, forbid_unknown_fields=False):
    lora_name: str
    lora_path: str
    base_model_name: str | None = None  # vLLM's field; not checked


class UnloadLoRAAdapterRequest(Struct, forbid_unknown_fields=False):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's field: when given, it must be the adapter's


def _updating(request: Request) -> ServerState:
    st = state_of(request)
    st.owner(request)
    if not st.config.allow_runtime_lora_updating:
        raise APIError(404, "runtime LoRA updating is off: start the server with --allow-runtime-lora-updating "
                            "(or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)", "not_found_error", None, "not_found")
    if st.runtime.engine is None or not st.runtime.engine_info.lora_enabled:
        raise bad_request("this server serves no LoRA adapters: start it with --enable-lora", "lora_name")
    return st


@api
async def load_lora_adapter(request: Request) -> Response:
    st = _updating(request)
    req: LoadLoRAAdapterRequest = decode(await read_body(request, st.config.max_body_bytes), LoadLoRAAdapterRequest)
    if req.lora_name == st.model_name:
        raise bad_request(f"lora_name {req.lora_name!r} is the base model's name", "lora_name")
    await st.runtime.load_lora_adapter(req.lora_name, req.lora_path, req.base_model_name)  # 400 when bad
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@api
async def unload_lora_adapter(request: Request) -> Response:
    st = _updating(request)
    req: UnloadLoRAAdapterRequest = decode(await read_body(request, st.config.max_body_bytes),
                                           UnloadLoRAAdapterRequest)
    have = st.runtime.loras.get(req.lora_name)
    if have is None:
        raise APIError(404, f"the LoRA adapter {req.lora_name!r} cannot be found", "not_found_error", "lora_name",
                       "model_not_found")
    if req.lora_int_id is not None and req.lora_int_id != have.lora_int_id:
        raise bad_request(f"lora_int_id {req.lora_int_id} is not adapter {req.lora_name!r}'s ({have.lora_int_id})",
                          "lora_int_id")
    st.runtime.unload_lora_adapter(req.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


ROUTES = [
    Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
]

OPERATIONS = [
    Operation("post", "/v1/load_lora_adapter", "serve a LoRA adapter under a new model name (vLLM)", None,
              LoadLoRAAdapterRequest, media_type="text/plain", errors=(400, 401, 404, 413, 500)),
    Operation("post", "/v1/unload_lora_adapter", "stop serving a LoRA adapter (vLLM)", None,
              UnloadLoRAAdapterRequest, media_type="text/plain", errors=(400, 401, 404, 413, 500)),
]
