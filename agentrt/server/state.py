"""What the routes share (`ServerState`): the runtime, the store, the metrics, the limits, and the checks
every route makes (API key, model name, capacity). `create_app`'s lifespan builds it; routes read it
with `state_of(request)`."""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Any

from starlette.requests import Request

from agentrt._runtime import Runtime
from agentrt.server.config import ServerConfig
from agentrt.server.errors import APIError
from agentrt.server.metrics import Metrics
from agentrt.server.schemas import Model
from agentrt.server.store import Store


class ServerState:
    """What the routes share: the runtime, the store, the metrics, limits."""

    def __init__(self, config: ServerConfig, runtime: Runtime, store: Store | None, metrics: Metrics) -> None:
        self.config = config
        self.runtime = runtime
        self.store = store
        self.metrics = metrics
        info = runtime.engine_info
        self.model_name = config.model_id()
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.max_tokens_limit = min(config.max_tokens_limit or self.max_model_len, self.max_model_len)
        self.pooling_method = config.pooling or info.pooling_method
        self.sampling_defaults = info.generation_defaults  # the model's generation config (vLLM's)
        self.created = int(time.time())
        self.draining = False
        self._keys = {hashlib.sha256(k.encode()).hexdigest()[:16]: k.encode() for k in config.api_keys}

    def owner(self, request: Request) -> str | None:
        """The fingerprint of the request's API key (its owner and cache salt); 401 when keys are set
        and the request has none of them."""
        if not self._keys:
            return None
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":  # Anthropic's clients send `x-api-key: <key>`
            key = request.headers.get("x-api-key", "")
        key = key.strip()
        if key:
            fp = hashlib.sha256(key.encode()).hexdigest()[:16]
            expected = self._keys.get(fp)
            if expected is not None and hmac.compare_digest(expected, key.encode()):
                return fp
        raise APIError(401, "missing or wrong API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`)",
                       "authentication_error", None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names, None for the base model; 404 for any other name."""
        if model is None or model in (self.model_name, ""):
            return None
        if model in self.runtime.loras:
            return model
        adapters = "".join(f", {n!r}" for n in sorted(r.lora_name for r in self.runtime.loras.requests()))
        raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}{adapters}",
                       "not_found_error", "model", "model_not_found")

    def model_of(self, call: Any) -> str:
        """The model name a call's response shows: its LoRA adapter's, else the served model's."""
        return call.model or self.model_name

    def model_cards(self) -> list[Model]:
        """/v1/models' entries: the base model, then each LoRA adapter (its parent the base, as vLLM's)."""
        return [Model(self.model_name, self.created, max_model_len=self.max_model_len),
                *(Model(r.lora_name, self.created, max_model_len=self.max_model_len, root=r.lora_path,
                        parent=self.model_name) for r in self.runtime.loras.requests())]

    def check_capacity(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable", None, "draining",
                           {"Retry-After": "5"})
        waiting = self.runtime.num_waiting_calls()
        if waiting >= self.config.max_waiting:
            raise APIError(429, f"too many queued calls ({waiting} >= --max-waiting {self.config.max_waiting})",
                           "rate_limit_error", None, "overloaded", {"Retry-After": "1"})


def state_of(request: Request) -> ServerState:
    return request.app.state.server
