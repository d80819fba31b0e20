"""`agentrt serve`'s start-up checks: what uvicorn, the store or the model's load would otherwise find only
once the server started (a traceback and exit 1 or 3, after the model loaded), checked before anything loads.
Each failure is a ValueError naming the flag, which `agentrt serve` prints in one line, exiting 2.

    check_startup(config, host="127.0.0.1", port=8000)   # -> the model's directory

Checked: the listening address (`--host` resolves, `--port` is a port and free there), `--root-path`, the
HTTPS pair (`--ssl-keyfile` / `--ssl-certfile` load as a key and its certificate), the model
(`engine.loader.resolve_model`), the sampling defaults (`--generation-config`, `--override-generation-config`)
and the records' database (`--db`: connected to once). The flags the configs check themselves (`ServerConfig`,
`EngineConfig`, `agentrt._cli_options`) are not checked again here.
"""

from __future__ import annotations

import socket
import ssl
from pathlib import Path
from typing import Any

from agentrt.server.config import ServerConfig


def check_startup(config: ServerConfig, *, host: str | None = None, port: int | None = None, root_path: str = "",
                  ssl_keyfile: str | None = None, ssl_certfile: str | None = None) -> Path:
    """Check what `serve` needs beyond its config's own checks; ValueError naming the flag. `host` / `port`:
    the address to listen on (None: not checked). Returns the model's directory."""
    from agentrt.engine.loader import resolve_model

    check_root_path(root_path)
    check_https(ssl_keyfile, ssl_certfile)
    model_path = resolve_model(config.model)  # ModelNotFoundError (a ValueError) names the path
    check_generation_config(model_path, config.engine)
    check_db(config)
    if host is not None and port is not None:
        check_address(host, port)  # last: the others do not depend on what else runs on this machine
    return model_path


def check_root_path(root_path: str) -> None:
    if root_path and (not root_path.startswith("/") or root_path.endswith("/")):
        raise ValueError(f"--root-path must start with '/' and not end with one, got {root_path!r}")


def check_https(keyfile: str | None, certfile: str | None) -> None:
    """Both or neither; files that load as a private key and its certificate (uvicorn loads them once the model
    has loaded, and a bad pair ended the server with a traceback)."""
    if (keyfile is None) != (certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both or neither, got "
                         f"--ssl-keyfile {keyfile!r} and --ssl-certfile {certfile!r}")
    if keyfile is None or certfile is None:
        return
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile)):
        if not Path(path).is_file():
            raise ValueError(f"{flag} {path!r} is not a file")

    class Encrypted(Exception):
        pass

    def no_password() -> bytes:
        raise Encrypted  # uvicorn would ask on the terminal, once the model has loaded

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile, password=no_password)
    except Encrypted:
        raise ValueError(f"--ssl-keyfile {keyfile!r} is encrypted, and agentrt serve takes no password for "
                         "it") from None
    except ssl.SSLError as e:
        raise ValueError(f"--ssl-certfile {certfile!r} and --ssl-keyfile {keyfile!r} do not load as a certificate "
                         f"and its private key (PEM): {e.reason or e}") from None
    except OSError as e:
        raise ValueError(f"--ssl-certfile {certfile!r} / --ssl-keyfile {keyfile!r} cannot be read: "
                         f"{e.strerror or e}") from None


def check_address(host: str, port: int) -> None:
    """`port` is a TCP port, `host` resolves, and the pair is free to listen on now (uvicorn binds it once the
    model has loaded)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port!r}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host!r} does not resolve: {getattr(e, 'strerror', None) or e}") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(address)
        except OSError as e:
            raise ValueError(f"--host {host!r} --port {port}: cannot listen there: {e.strerror or e}") from None


def check_generation_config(model_path: Path, engine: dict[str, Any]) -> None:
    """The sampling defaults the engine would read at its load (engine.generation_config), read now."""
    from agentrt.engine.generation_config import generation_defaults

    source = engine.get("generation_config") or "auto"
    if isinstance(source, str) and source not in ("auto", "vllm") and not Path(source).is_dir():
        raise ValueError(f"--generation-config {source!r} is not a directory (auto, vllm, or a directory holding "
                         "generation_config.json)")
    try:
        generation_defaults(model_path, source)
    except ValueError as e:
        raise ValueError(f"--generation-config {source!r}: {e}") from None
    override = engine.get("override_generation_config")
    if override:
        try:
            generation_defaults(model_path, "vllm", override)
        except ValueError as e:
            raise ValueError(f"--override-generation-config: {e}") from None


def check_db(config: ServerConfig) -> None:
    """The records' database takes a connection (store.check_url); nothing with `--db none`."""
    from agentrt.server.store import check_url, default_url

    if (config.db or "").lower() == "none":
        return
    url = config.db or default_url(config.model_id())
    try:
        check_url(url)
    except ValueError as e:
        given = repr(config.db) if config.db else f"(default {url})"
        raise ValueError(f"--db {given}: {e}") from None
