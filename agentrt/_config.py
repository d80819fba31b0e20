"""`RuntimeConfig`: what a `Runtime` is told, checked in full before the model loads.

One config per layer: `engine.EngineConfig` below (the `engine` field holds its other fields),
`RuntimeConfig` here, and the server's `ServerConfig`, which embeds this one (it is a RuntimeConfig
with the server's own fields added), so `Runtime(server_config)` serves exactly what the server was
told.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrt._lora import parse_lora_modules
from agentrt._reasoning import reasoning_parser
from agentrt._retention import RetentionConfig
from agentrt._toolparsers import tool_call_parser
from agentrt.engine import SchedulingPolicy


@dataclass(slots=True)
class RuntimeConfig:
    """A runtime's settings. ValueError / TypeError name the bad field and value."""

    model: str | None = None  # model directory or .gguf file; None = the default model
    policy: str | SchedulingPolicy = "plas"  # scheduling policy name ("plas", "atlas", "mlfq", "fcfs") or instance
    policy_kwargs: dict[str, Any] | None = None  # arguments for a policy given by name, e.g. {"beta": 4.0}
    engine: dict[str, Any] = field(default_factory=dict)  # any other engine.EngineConfig field (num_blocks, ...)
    program_idle_timeout_s: float | None = None  # programs started by id end after this long without calls
    retention: RetentionConfig | bool = True  # KV pins across tool calls and reservations (agentrt._retention)
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser: chat replies' thinking apart from the answer
    tool_call_parser: str | None = "auto"  # vLLM's --tool-call-parser: the format tool calls are read in
    lora_modules: Any = None  # LoRA adapters served by name: {name: directory}, `name=path` strings or JSON objects
    trace: bool | str = False  # True: keep each program's call records for `Runtime.timeline`; an http(s) URL:
    # that too, and export a span per program and call to that OTLP/HTTP traces endpoint (agentrt._tracing)

    def __post_init__(self) -> None:
        if isinstance(self.retention, bool):
            self.retention = RetentionConfig(ttl=self.retention)
        if not isinstance(self.retention, RetentionConfig):
            raise TypeError(f"retention must be a RetentionConfig or a bool, got {self.retention!r}")
        timeout = self.program_idle_timeout_s
        if timeout is not None and not (isinstance(timeout, (int, float)) and 0 < timeout < math.inf):
            raise ValueError(f"program_idle_timeout_s must be a positive number of seconds, got {timeout!r}")
        if not isinstance(self.engine, dict):
            raise TypeError(f"engine must be a dict of EngineConfig fields, got {self.engine!r}")
        reasoning_parser(self.reasoning_parser)  # an unknown name fails here, naming the choices
        tool_call_parser(self.tool_call_parser)  # likewise
        parse_lora_modules(self.lora_modules)  # a malformed entry fails here, naming it
        if not isinstance(self.trace, (bool, str)) or (
                isinstance(self.trace, str) and not self.trace.startswith(("http://", "https://"))):
            raise ValueError(f"trace must be True, False or an OTLP/HTTP traces endpoint URL (http://...), "
                             f"got {self.trace!r}")

    def model_id(self) -> str:
        """The model's name as `agentrt serve` serves it: the model file's (or directory's) name, or the default
        model's (a ServerConfig's `served_model_name` first)."""
        if self.model is None:
            from agentrt.engine.loader import DEFAULT_MODEL_NAME

            return DEFAULT_MODEL_NAME
        path = Path(self.model)
        return path.stem if path.suffix == ".gguf" else path.name

    def model_names(self) -> tuple[str, ...]:
        """The names a call's `model` may give the base model (rather than a LoRA adapter): `model_id()`, and the
        model's path as given. The in-process runtime and the server take the same ones."""
        return (self.model_id(),) if self.model is None else tuple(dict.fromkeys((self.model_id(), str(self.model))))
