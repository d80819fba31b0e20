"""What the routes share (`ServerState`): the runtime, the store, the metrics, the limits, and the checks
every route makes (API key, model name). `create_app`'s lifespan builds it; routes read it with
`state_of(request)`, and a generation route reads its request with `read_call`:

    st, who, req = await read_call(request, ChatCompletionRequest)   # 401, 413, 400, 404 in that order
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request

from agentrt._runtime import Runtime
from agentrt.server.bodies import decode_body
from agentrt.server.config import ServerConfig
from agentrt.server.errors import APIError, bad_request
from agentrt.server.metrics import Metrics
from agentrt.server.schemas import Model, ProgramId
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
        self.recorder: Any = None  # agentrt.server.recorder.Recorder: records and metrics of ended calls
        self.history: Any = None  # agentrt.server.history.History: the live page's charts, the last 15 minutes
        self.peers: Any = None  # a Ray replica's agentrt.scale.peers.ReplicaPeers: program records and /metrics
        # across replicas; None on one server
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
        """The LoRA adapter a request's `model` names, None for the base model (any of the names the in-process
        runtime takes for it: RuntimeConfig.model_names); 404 for any other name."""
        if model is None or model == "" or model in self.runtime.model_names:
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

def state_of(request: Request) -> ServerState:
    return request.app.state.server


@dataclass(slots=True)
class Caller:
    """Who a generation request comes from and what program it is for, read once from its headers and body."""

    owner: str | None  # the fingerprint of its API key (ServerState.owner)
    model: str | None  # the LoRA adapter its `model` names; None: the base model
    program_id: str | None  # X-Program-Id or the body's program_id; None: a program of its own
    thread_id: str | None  # X-Thread-Id or the body's thread_id
    name: str | None  # X-Program-Name: the name of a program its call starts (None: the route's default)
    last_call: bool  # X-Last-Call: the program makes no more calls, so nothing of it is pinned after this one
    traceparent: str | None = None  # W3C trace context: the program's spans join the caller's trace (--otlp-...)


async def read_call(request: Request, type_: type) -> tuple[ServerState, Caller, Any]:
    """What every generation route starts with: the key checked (401 before anything else), the body read
    (413) and decoded into `type_` (400), its model (404 for an unknown one), the program's keys and name."""
    st: ServerState = request.app.state.server
    owner = st.owner(request)
    req = await decode_body(request, type_, st.config.max_body_bytes)
    model = st.check_model(req.model)
    pid, tid = program_keys(request, getattr(req, "program_id", None), getattr(req, "thread_id", None))
    if st.peers is not None and pid is not None:  # a program other replicas may run: one owner, one service
        await st.peers.admit(pid, owner)
    last = request.headers.get("x-last-call", "").strip().lower() in ("1", "true", "yes")
    return st, Caller(owner, model, pid, tid, program_name(request), last, request.headers.get("traceparent")), req


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


def program_name(request: Request) -> str | None:
    """The name a call gives the program it starts: the `X-Program-Name` header (None without one)."""
    name = request.headers.get("x-program-name")
    if name is not None and (not 0 < len(name) <= 128 or not name.isprintable()):
        raise bad_request(f"header x-program-name {name[:40]!r} must be 1-128 printable characters", "program_name")
    return name
