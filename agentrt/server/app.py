"""The ASGI app: configuration, start-up and shut-down, authentication, and the small routes.

    app = create_app(ServerConfig(model=None, policy="plas"))   # uvicorn.run(app, ...)

The lifespan enters a `Runtime` (the same one the in-process API uses), opens the store and the
metrics, and on shut-down (SIGTERM: uvicorn stops accepting and drains in-flight requests first)
ends the programs still running and flushes every record.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agentrt._lora import parse_lora_modules
from agentrt._reasoning import reasoning_parser
from agentrt._runtime import Runtime
from agentrt._toolparsers import tool_call_parser
from agentrt.server import ui
from agentrt.server.errors import APIError, error_response
from agentrt.server.metrics import EngineState, Metrics
from agentrt.server.openapi import Operation, build
from agentrt.server.recorder import Recorder
from agentrt.server.schemas import Health, Model, ModelList
from agentrt.server.store import Store
from agentrt.engine.pooling import POOLING_METHODS
from agentrt.engine.pooling import default_method as default_pooling


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentrt")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0.0.0+unknown"


VERSION = _version()

logger = logging.getLogger("agentrt.server")


@dataclass(slots=True)
class ServerConfig:
    """Everything `agentrt serve` is told. Limits are enforced before a call reaches the engine."""

    model: str | None = None  # model directory or .gguf; None = the default model
    policy: str = "plas"  # scheduling policy name
    policy_kwargs: dict[str, Any] | None = None
    engine: dict[str, Any] = field(default_factory=dict)  # other EngineConfig fields
    db: str | None = None  # SQLAlchemy URL; None = SQLite file under the cache dir; "none" = no store
    api_keys: list[str] = field(default_factory=list)  # empty = no authentication
    served_model_name: str | None = None  # the model id clients use; None = the model file's name
    program_idle_timeout_s: float = 600.0  # a program without calls this long ends by itself
    max_waiting: int = 256  # queued calls (no token yet) beyond which new calls get 429
    drain_timeout_s: float = 30.0  # SIGTERM: how long in-flight requests may finish
    max_body_bytes: int = 4 << 20  # 413 beyond
    max_n: int = 16  # completions per call at most
    max_tokens_limit: int | None = None  # max_tokens at most; None = the model's context
    max_programs_kept: int = 100_000  # ended programs kept in the database (older ones pruned)
    trust_request_chat_template: bool = False  # vLLM's flag: a request may bring its own chat_template
    exclude_tools_when_tool_choice_none: bool = False  # vLLM's flag: tool_choice "none" leaves the tools out
    # of the prompt (by default they stay described, so a conversation's calls share their prefix)
    return_tokens_as_token_ids: bool = False  # vLLM's flag: log-probs name tokens "token_id:{id}" unless a request
    # says otherwise (its return_tokens_as_token_ids)
    chat_template: str | None = None  # Jinja chat template, or a path to one; None = the model's.
    # After validation the template's text
    allowed_origins: list[str] | None = None  # CORS: origins browsers may call from ("*" = any); None = no CORS
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])  # CORS: methods a browser may use
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])  # CORS: request headers a browser may send
    allow_credentials: bool = False  # CORS: browsers may send cookies and credentials
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser: chat replies' thinking apart from the answer
    tool_call_parser: str = "auto"  # vLLM's --tool-call-parser: the format calls are read in (agentrt._toolparsers)
    pooling: str | None = None  # /v1/embeddings' pooling (engine.pooling); None = the checkpoint's, else "last"
    max_embedding_inputs: int = 2048  # inputs of one /v1/embeddings request at most (OpenAI's limit)
    lora_modules: list[str] = field(default_factory=list)  # vLLM's --lora-modules: name=path or JSON objects;
    # clients name an adapter as the model. Any turns on the engine's enable_lora
    allow_runtime_lora_updating: bool = field(  # /v1/load_lora_adapter and /v1/unload_lora_adapter answer
        default_factory=lambda: os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"))

    def __post_init__(self) -> None:
        for name in ("max_waiting", "max_body_bytes", "max_n", "max_programs_kept", "max_embedding_inputs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        for name in ("program_idle_timeout_s", "drain_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError(f"max_tokens_limit must be >= 1, got {self.max_tokens_limit!r}")
        if any(not k for k in self.api_keys):
            raise ValueError("API keys must be non-empty strings")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            v = getattr(self, name)
            if (v is not None or name != "allowed_origins") and not (
                isinstance(v, list) and all(isinstance(s, str) for s in v)
            ):
                raise ValueError(f"{name} must be a list of strings, got {v!r}")
        for name in ("allow_credentials", "return_tokens_as_token_ids"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.chat_template is not None:
            self.chat_template = load_chat_template(self.chat_template)
        reasoning_parser(self.reasoning_parser)  # an unknown name fails here, naming the choices
        tool_call_parser(self.tool_call_parser)  # likewise
        for name, path, _ in parse_lora_modules(self.lora_modules):  # a malformed entry fails here, naming it
            if not (Path(path) / "adapter_config.json").is_file():
                raise ValueError(f"--lora-modules {name}={path}: no adapter_config.json there (a PEFT LoRA directory)")
        if self.pooling is not None and self.pooling not in POOLING_METHODS:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_METHODS)}, got {self.pooling!r}")


def load_chat_template(value: str) -> str:
    """The text of a chat template given as a file path or as the template itself (vLLM's --chat-template
    takes both). ValueError when it is neither, or when it does not compile."""
    from agentrt.engine.chat_template import syntax_error

    if not isinstance(value, str) or not value:
        raise ValueError(f"chat_template must be a Jinja template or a path to one, got {value!r}")
    try:
        is_file = Path(value).is_file()
    except (OSError, ValueError):  # too long for a path, or a NUL in it: not a file
        is_file = False
    if is_file:
        try:
            text = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat_template file {value!r} cannot be read: {e}") from None
        where = f"file {value!r}"
    elif "{{" in value or "{%" in value:
        text, where = value, "text"
    else:
        raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")
    problem = syntax_error(text)
    if problem is not None:
        raise ValueError(f"chat_template {where} does not compile: {problem}")
    return text


class ServerState:
    """What the routes share: the runtime, the store, the metrics, limits."""

    def __init__(self, config: ServerConfig, runtime: Runtime, store: Store | None, metrics: Metrics) -> None:
        self.config = config
        self.runtime = runtime
        self.store = store
        self.metrics = metrics
        core = runtime._engine().core
        self.model_name = config.served_model_name or _model_name(config.model, core.model_path)
        self.max_model_len = core.max_model_len
        self.vocab_size = core.model.args.vocab_size
        self.max_tokens_limit = min(config.max_tokens_limit or self.max_model_len, self.max_model_len)
        self.pooling_method = config.pooling or default_pooling(core.model_path)
        self.sampling_defaults = core.generation_defaults  # the model's generation config (vLLM's)
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


def _model_name(model: str | None, path: Path) -> str:
    if model is None:
        from agentrt.engine.loader import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    return Path(model).stem if Path(model).suffix == ".gguf" else Path(model).name


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or 413 once it passes `limit` bytes (checked while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes is over the limit of {limit} bytes (--max-body-bytes)",
                       "invalid_request_error", None, "body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes (--max-body-bytes)",
                           "invalid_request_error", None, "body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def state_of(request: Request) -> ServerState:
    return request.app.state.server


def json_response(obj: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status, media_type="application/json")


# --- small routes ---------------------------------------------------------------------------
async def health(request: Request) -> Response:
    st = state_of(request)
    return json_response(Health("draining" if st.draining else "ok"), 503 if st.draining else 200)


async def models(request: Request) -> Response:
    st = state_of(request)
    st.owner(request)
    return json_response(ModelList(st.model_cards()))


async def metrics(request: Request) -> Response:
    st = state_of(request)
    st.owner(request)
    body, content_type = st.metrics.render()
    return Response(body, media_type=content_type)


async def openapi(request: Request) -> Response:
    state_of(request).owner(request)
    return json_response(request.app.state.openapi)


def _route_modules() -> list[Any]:
    """The modules holding the API's routes (each with ROUTES and OPERATIONS), in the document's order."""
    from agentrt.server import (
        classify_routes,
        embeddings_routes,
        lora_routes,
        messages_routes,
        openai_routes,
        program_routes,
        responses_routes,
        tokenize_routes,
    )

    return [openai_routes, responses_routes, messages_routes, program_routes, tokenize_routes, embeddings_routes,
            classify_routes, lora_routes, ui]


def _operations() -> list[Operation]:
    return [
        Operation("get", "/health", "liveness", Health, errors=(503,), auth=False),
        Operation("get", "/v1/models", "the served model and its LoRA adapters", ModelList, errors=(401,)),
        Operation("get", "/metrics", "Prometheus metrics", None, media_type="text/plain", errors=(401,)),
        Operation("get", "/openapi.json", "this document", None, media_type="application/json", errors=(401,)),
        *(op for m in _route_modules() for op in m.OPERATIONS),
    ]


def create_app(config: ServerConfig | None = None, *, runtime: Runtime | None = None) -> Starlette:
    """The server app. `runtime`: an existing (not yet entered) Runtime to serve, e.g. for tests;
    by default one is made from `config`."""

    config = config or ServerConfig()
    if runtime is None:
        runtime = Runtime(config.model, config.policy, policy_kwargs=config.policy_kwargs,
                          program_idle_timeout_s=config.program_idle_timeout_s,
                          reasoning_parser=config.reasoning_parser, tool_call_parser=config.tool_call_parser,
                          lora_modules=config.lora_modules or None, **config.engine)
    else:
        if runtime.program_idle_timeout_s is None:
            runtime.program_idle_timeout_s = config.program_idle_timeout_s
        if config.reasoning_parser is not None:
            runtime.reasoning = reasoning_parser(config.reasoning_parser)
        if config.tool_call_parser != "auto":
            runtime.tool_parser = tool_call_parser(config.tool_call_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        store = None if (config.db or "").lower() == "none" else Store(config.db)
        if store is not None:
            await anyio.to_thread.run_sync(store.start)
        try:
            async with runtime:
                if config.chat_template is not None:  # every chat prompt renders with the tokenizer's template
                    runtime.tokenizer.chat_template = config.chat_template
                policy_name = getattr(runtime.policy, "name", config.policy)
                metrics_ = Metrics(state_fn=lambda: _engine_state(runtime))
                st = ServerState(config, runtime, store, metrics_)
                recorder = Recorder(store, metrics_, policy_name, config.max_programs_kept)
                runtime.observers.append(recorder)
                app.state.server = st
                logger.info("serving %s (policy %s, store %s)", st.model_name, policy_name, store or "off")
                try:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(recorder.prune_periodically)
                        yield
                        tg.cancel_scope.cancel()
                finally:
                    st.draining = True
                # leaving `runtime` ends the programs still running (recorded through the recorder)
        finally:
            if store is not None:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(store.close)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        *(route for m in _route_modules() for route in m.ROUTES),
    ]
    middleware = []
    if config.allowed_origins is not None:  # preflights are answered here, before any route asks for a key
        middleware.append(Middleware(
            CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=config.allowed_methods,
            allow_headers=config.allowed_headers, allow_credentials=config.allow_credentials,
            expose_headers=["X-Program-Id", "X-Thread-Id"],
        ))
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={Exception: _on_error, APIError: _on_error})
    app.state.openapi = build(_operations(), "agentrt", VERSION)
    return app


async def _on_error(request: Request, exc: Exception) -> Response:
    return error_response(exc)


def _engine_state(runtime: Runtime) -> EngineState:
    """Gauges and cumulative counters for /metrics, read at scrape time."""
    engine = runtime._engine()
    core = engine.core
    kv = engine.kv_stats()
    levels: dict[int, int] = {}
    level_of = getattr(runtime.policy, "level", None)
    reqs = list(core.requests.values())
    if level_of is not None:
        for r in reqs:
            if r.policy_state:
                lv = level_of(r)
                levels[lv] = levels.get(lv, 0) + 1
    running, waiting = list(core.scheduler.running), list(core.scheduler.waiting)  # copies: the engine thread moves them
    lora: dict[str, Any] = {}
    if core.loras is not None:  # vLLM's lora_requests_info: the adapters of the requests in each queue
        lora = {"max_lora": core.config.max_loras, "running_lora_adapters": _adapter_names(running),
                "waiting_lora_adapters": _adapter_names(waiting)}
    return EngineState(
        running=len(running), waiting=len(waiting),
        kv_usage=1.0 - kv.num_free_blocks / kv.num_blocks, prefix_queries_tokens=kv.prefix_queries_tokens,
        prefix_hit_tokens=kv.prefix_hit_tokens, num_preemptions=kv.num_preemptions,
        programs_active=len(runtime.programs.running()), calls_per_level=levels,
        kv_pinned_blocks=kv.num_pinned_blocks, kv_reserved_blocks=kv.num_reserved_blocks, ttl_hits=kv.ttl_hits,
        ttl_misses=kv.ttl_misses, pin_expiries=kv.pin_expiries, recomputed_prefill_tokens=kv.recomputed_prefill_tokens,
        **lora,
    )


def _adapter_names(requests: list[Any]) -> str:
    """The LoRA adapters some of `requests` run with, sorted and comma-joined (one label value per set)."""
    return ",".join(sorted({r.lora.name for r in requests if r.lora is not None}))


def env_api_keys() -> list[str]:
    return [k for k in os.environ.get("AGENTRT_API_KEYS", "").replace(",", " ").split() if k]
