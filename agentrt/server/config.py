"""`agentrt serve`'s configuration: `ServerConfig`, checked in full before the model loads."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from agentrt._config import RuntimeConfig
from agentrt._lora import parse_lora_modules
from agentrt.engine.pooling import POOLING_METHODS


@dataclass(slots=True)
class ServerConfig(RuntimeConfig):
    """Everything `agentrt serve` is told: the runtime's config (model, policy, engine fields, parsers,
    LoRA modules: `RuntimeConfig`, which this one embeds, so `Runtime(server_config)` serves it) and the
    server's own fields. Limits are enforced before a call reaches the engine."""

    db: str | None = None  # SQLAlchemy URL; None = the served model's SQLite file under the cache dir
    # (store.default_url); "none" = no store. A database holds one server's records (see recorder.open_store)
    api_keys: list[str] = field(default_factory=list)  # empty = no authentication
    served_model_name: str | None = None  # the model id clients use; None = the model file's name
    program_idle_timeout_s: float | None = 600.0  # a program without calls this long ends by itself
    max_waiting: int = 256  # queued calls (no token yet) beyond which new calls get 429
    drain_timeout_s: float = 30.0  # SIGTERM: how long in-flight requests may finish
    max_body_bytes: int = 4 << 20  # 413 beyond
    max_n: int = 16  # completions per call at most
    max_tokens_limit: int | None = None  # max_tokens at most; None = the model's context
    max_programs_kept: int = 100_000  # ended programs kept in the database (older ones pruned)
    otlp_traces_endpoint: str | None = None  # vLLM's flag: export a span per program and call there (OTLP/HTTP,
    # agentrt._tracing; needs the otel extra); None: no tracing, nothing built
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
        if self.otlp_traces_endpoint is not None:
            from agentrt._tracing import traces_url

            traces_url(self.otlp_traces_endpoint)  # a malformed URL fails here, naming it
            try:
                import opentelemetry.exporter.otlp.proto.http  # noqa: F401
                import opentelemetry.sdk  # noqa: F401
            except ImportError:
                raise ValueError("otlp_traces_endpoint needs the otel extra: pip install 'agentrt[otel]' "
                                 "(opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)") from None
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
        RuntimeConfig.__post_init__(self)  # the runtime's fields (zero-argument super() fails in a slots dataclass)
        for name, path, _ in parse_lora_modules(self.lora_modules):  # a malformed entry fails here, naming it
            if not (Path(path) / "adapter_config.json").is_file():
                raise ValueError(f"--lora-modules {name}={path}: no adapter_config.json there (a PEFT LoRA directory)")
        if self.pooling is not None and self.pooling not in POOLING_METHODS:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_METHODS)}, got {self.pooling!r}")

    def model_id(self) -> str:
        """The model id clients use: `served_model_name`, else the model file's (or directory's) name."""
        return self.served_model_name or RuntimeConfig.model_id(self)


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


def env_api_keys() -> list[str]:
    return [k for k in os.environ.get("AGENTRT_API_KEYS", "").replace(",", " ").split() if k]
