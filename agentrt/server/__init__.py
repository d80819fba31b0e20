"""`agentrt serve`: the runtime over an OpenAI-compatible HTTP API keyed by program id.

    from agentrt.server import ServerConfig, create_app, serve
    serve(ServerConfig(policy="plas"), host="127.0.0.1", port=8000)

Modules: `schemas` (the contract, msgspec), `app` (config, lifespan, auth, small routes),
`openai_routes` (chat / completions), `program_routes` (/v1/programs), `openapi`, `sse`, `errors`,
`store` (SQLAlchemy), `metrics` (Prometheus), `recorder` (runtime events to both).
"""

from __future__ import annotations

from agentrt.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app", "serve"]


def serve(config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> int:
    """Run the server until SIGINT / SIGTERM; in-flight requests get `config.drain_timeout_s` to finish,
    records are flushed, and the process exits 0."""
    import contextlib
    import signal
    import threading

    import uvicorn

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

    app = create_app(config)
    print(f"agentrt serve: loading the model, then listening on http://{host}:{port}", flush=True)
    server = Server(uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=config.drain_timeout_s,
        lifespan="on", access_log=False,
    ))
    server.run()
    return 0
