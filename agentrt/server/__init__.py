"""`agentrt serve`: the runtime over an OpenAI-compatible HTTP API keyed by program id.

    from agentrt.server import ServerConfig, create_app, serve
    serve(ServerConfig(policy="plas"), host="127.0.0.1", port=8000)

Modules: `schemas` (the contract, msgspec), `config` (ServerConfig), `state` (what routes share: runtime,
store, metrics, auth and limit checks), `bodies` (body read and JSON response), `app` (the factory:
lifespan, route table, small routes), `openai_routes` (chat / completions), `program_routes`
(/v1/programs), `openapi`, `sse`, `errors`, `store` and `store_reads` (SQLAlchemy), `metrics` (Prometheus),
`recorder` (runtime events to both; `open_store`). Routes import `state` and `bodies`, never `app`, which imports them all.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from agentrt.server.config import ServerConfig

if TYPE_CHECKING:
    from agentrt.server.app import create_app

__all__ = ["ServerConfig", "create_app", "serve"]


def __getattr__(name: str) -> object:
    if name == "create_app":  # loaded on use: the app module imports every route module, which import this package
        from agentrt.server.app import create_app

        return create_app
    raise AttributeError(f"module 'agentrt.server' has no attribute {name!r}")


def serve(
    config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", *, root_path: str = "",
    ssl_keyfile: str | None = None, ssl_certfile: str | None = None, access_log: bool = True,
) -> int:
    """Run the server until SIGINT / SIGTERM; in-flight requests get `config.drain_timeout_s` to finish,
    records are flushed, and the process exits 0.

    `root_path`: the path prefix a proxy serves this server under; `ssl_keyfile` and `ssl_certfile`:
    HTTPS (both or neither); `access_log`: uvicorn's line per request. Checked before the model loads
    (`startup.check_startup`: the address, HTTPS pair, model, sampling defaults and database; a ValueError
    naming the flag). An error while the model loads is raised here as itself, once uvicorn has stopped,
    instead of uvicorn's lifespan traceback and exit 3."""
    import signal
    import threading

    import uvicorn

    from agentrt.server.startup import check_startup

    check_startup(config, host=host, port=port, root_path=root_path, ssl_keyfile=ssl_keyfile,
                  ssl_certfile=ssl_certfile)  # before uvicorn says anything

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # uvicorn re-raises the signal after a graceful stop: exit 0 instead
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    from agentrt.server.app import create_app

    app = create_app(config)
    failure = _StartupFailure(app)
    scheme = "https" if ssl_certfile else "http"
    print(f"agentrt serve: loading the model, then listening on {scheme}://{host}:{port}", flush=True)
    server = Server(uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=config.drain_timeout_s,
        lifespan="on", access_log=access_log, root_path=root_path, ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile,
    ))
    logging.getLogger("uvicorn.error").addFilter(failure)
    try:
        server.run()
    except SystemExit:  # uvicorn's exit 3: a failed start-up, or a port it could not bind (said in its log)
        if failure.error is not None:
            raise failure.error from None
        return 1
    finally:
        logging.getLogger("uvicorn.error").removeFilter(failure)
    return 0


class _StartupFailure(logging.Filter):
    """Keeps what went wrong while the app started (the model's load) and silences uvicorn's report of it,
    a traceback in its log, so that `serve` can raise the error itself."""

    def __init__(self, app: Any) -> None:
        super().__init__()
        self.error: BaseException | None = None
        inner = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(a: Any) -> AsyncIterator[None]:
            started = False
            try:
                async with inner(a):
                    started = True
                    yield
            except Exception as e:
                if not started:
                    self.error = e
                raise

        app.router.lifespan_context = lifespan

    def filter(self, record: logging.LogRecord) -> bool:
        return self.error is None
