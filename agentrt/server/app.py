"""The ASGI app factory: start-up and shut-down, the route table, the error handler, the small routes.

    app = create_app(ServerConfig(model=None, policy="plas"))   # uvicorn.run(app, ...)

The lifespan enters a `Runtime` (the same one the in-process API uses), opens the store and the
metrics, and on shut-down (SIGTERM: uvicorn stops accepting and drains in-flight requests first)
ends the programs still running and flushes every record.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agentrt._reasoning import reasoning_parser
from agentrt._runtime import Runtime
from agentrt._toolparsers import tool_call_parser
from agentrt.server import ui
from agentrt.server.bodies import VERSION, json_response
from agentrt.server.config import ServerConfig
from agentrt.server.errors import APIError, error_response
from agentrt.server.history import History
from agentrt.server.metrics import CONTENT_TYPE_LATEST, EngineState, Metrics
from agentrt.server.openapi import Operation, build
from agentrt.server.recorder import Recorder, open_store
from agentrt.server.schemas import Health, ModelList
from agentrt.server.state import ServerState, state_of

logger = logging.getLogger("agentrt.server")


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
    body = await metrics_text(st)
    if st.peers is not None:  # every replica's series, each labelled by its replica
        body = await st.peers.metrics(body)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


async def metrics_text(st: ServerState) -> str:
    """This server's /metrics exposition now."""
    return st.metrics.render(await _engine_state(st.runtime))[0].decode()


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
        timeline_routes,
        tokenize_routes,
    )

    return [openai_routes, responses_routes, messages_routes, program_routes, tokenize_routes, embeddings_routes,
            classify_routes, lora_routes, timeline_routes, ui]


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
        runtime = Runtime(config)  # a ServerConfig is the runtime's config with the server's fields added
    else:
        if runtime.program_idle_timeout_s is None:
            runtime.program_idle_timeout_s = config.program_idle_timeout_s
        if config.reasoning_parser is not None:
            runtime.reasoning = reasoning_parser(config.reasoning_parser)
        if config.tool_call_parser != "auto":
            runtime.tool_parser = tool_call_parser(config.tool_call_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        store = await anyio.to_thread.run_sync(open_store, config)
        try:
            async with runtime:
                if config.chat_template is not None:  # every chat prompt renders with the tokenizer's template
                    runtime.tokenizer.chat_template = config.chat_template
                policy_name = getattr(runtime.policy, "name", config.policy)
                metrics_ = Metrics()  # the engine's state given at each scrape (`metrics`)
                st = ServerState(config, runtime, store, metrics_)
                recorder = Recorder(store, metrics_, policy_name, config.max_programs_kept)
                runtime.observers.append(recorder)
                st.recorder, st.history = recorder, History()
                if config.otlp_traces_endpoint is not None:  # else no tracer is built: nothing on the call path
                    runtime.start_tracing(config.otlp_traces_endpoint)
                app.state.server = st
                logger.info("serving %s (policy %s, store %s)", st.model_name, policy_name, store or "off")
                try:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(recorder.prune_periodically)
                        tg.start_soon(st.history.sample_periodically, st)
                        yield
                        tg.cancel_scope.cancel()
                finally:
                    st.draining = True
                # leaving `runtime` ends the programs still running (recorded through the recorder)
        finally:
            runtime.stop_tracing()  # the programs the runtime's end ended are in: flush their spans
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


async def _engine_state(runtime: Runtime) -> EngineState | None:
    """Gauges and cumulative counters for /metrics, from a snapshot of the engine between steps; None (the
    scrape serves the last known state) if taking it failed."""
    try:
        s, info = await runtime.engine_stats(), runtime.engine_info
    except Exception:
        logger.exception("metrics: reading the engine's state failed")
        return None
    kv = s.kv
    lora: dict[str, Any] = {}
    if info.lora_enabled:  # vLLM's lora_requests_info: the adapters of the requests in each queue
        lora = {"max_lora": info.max_loras, "running_lora_adapters": ",".join(s.running_lora_adapters),
                "waiting_lora_adapters": ",".join(s.waiting_lora_adapters)}
    return EngineState(
        running=s.num_running, waiting=s.num_waiting,
        kv_usage=1.0 - kv.num_free_blocks / kv.num_blocks, prefix_queries_tokens=kv.prefix_queries_tokens,
        prefix_hit_tokens=kv.prefix_hit_tokens, num_preemptions=kv.num_preemptions,
        programs_active=len(runtime.programs.running()), calls_per_level=dict(s.calls_per_level),
        kv_pinned_blocks=kv.num_pinned_blocks, kv_reserved_blocks=kv.num_reserved_blocks, ttl_hits=kv.ttl_hits,
        ttl_misses=kv.ttl_misses, pin_expiries=kv.pin_expiries, recomputed_prefill_tokens=kv.recomputed_prefill_tokens,
        running_seats=s.running_seats, kv_tiers=dict(kv.tiers),
        **lora,
    )


