"""The LoRA adapters a runtime serves by name (vLLM's `--lora-modules name=path`, and its
`/v1/load_lora_adapter`): a call names one as its model, `await agentrt.chat(messages, model="sql")`,
and runs on the base model plus that adapter (engine/lora.py), batched with every other call.

Names map to `engine.LoRARequest`s with ids of their own: an id is never reused, so K/V cached under an
adapter that was unloaded, or replaced under the same name, is never served to its successor.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any

from agentrt._errors import ConfigError, InvalidCallError
from agentrt.engine.lora import LoRARequest

MAX_ADAPTERS = 256  # named adapters at most (each loaded on first use, `max_loras` kept in memory)


class LoRAModules:
    """Adapter name -> LoRARequest; thread-safe (the server loads adapters from worker threads)."""

    def __init__(self) -> None:
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def add(self, name: str, path: str | Path, base_model_name: str | None = None) -> LoRARequest:
        """Name an adapter directory; ValueError when the name is taken or bad (the caller checks the files)."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a LoRA adapter's name must be a non-empty str, got {name!r}")
        if not isinstance(path, (str, Path)) or not str(path):
            raise ValueError(f"LoRA adapter {name!r}: its path must be a directory, got {path!r}")
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
            if len(self._by_name) >= MAX_ADAPTERS:
                raise ValueError(f"{MAX_ADAPTERS} LoRA adapters are loaded already; unload one first")
            req = LoRARequest(name, next(self._ids), str(path), base_model_name)
            self._by_name[name] = req
            return req

    def remove(self, name: str) -> LoRARequest:
        with self._lock:
            req = self._by_name.pop(name, None)
        if req is None:
            raise KeyError(name)
        return req

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self._by_name)

    def requests(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._by_name.values())

    def resolve(self, model: Any, program_id: str | None = None, base: tuple[str, ...] = ()) -> LoRARequest | None:
        """The adapter a call's `model` names; None for the base model: no model, "", or one of its names
        `base` (RuntimeConfig.model_names). InvalidCallError naming `model` for any other name."""
        if model is None or model == "" or model in base:
            return None
        req = self._by_name.get(model) if isinstance(model, str) else None
        if req is None:
            names = ", ".join(repr(n) for n in self._by_name) or "none"
            served = f"the model {base[0]!r} nor " if base else ""
            raise InvalidCallError(f"model {model!r} is neither {served}a LoRA adapter of this runtime (adapters: "
                                   f"{names}); leave model out for the base model", param="model",
                                   program_id=program_id)
        return req


def parse_lora_modules(specs: Any) -> list[tuple[str, str, str | None]]:
    """(name, path, base model name) of each adapter given as vLLM's `--lora-modules` takes them:
    `name=path` strings, JSON objects `{"name", "path", "base_model_name"}` (as dicts or text), or a
    {name: path} mapping. ConfigError naming a bad entry."""
    import json

    if specs is None:
        return []
    if isinstance(specs, dict):
        specs = [f"{k}={v}" for k, v in specs.items()]
    if isinstance(specs, str):
        specs = [specs]
    out = []
    for spec in specs:
        item = spec
        if isinstance(spec, str) and spec.lstrip().startswith("{"):
            try:
                item = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--lora-modules {spec!r} is not valid JSON: {e}") from None
        if isinstance(item, dict):
            name, path = item.get("name"), item.get("path")
            if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
                raise ConfigError(f"--lora-modules {spec!r} needs string fields 'name' and 'path'")
            out.append((name, path, item.get("base_model_name")))
        elif isinstance(item, str) and "=" in item and item.split("=", 1)[0] and item.split("=", 1)[1]:
            name, path = item.split("=", 1)
            out.append((name, path, None))
        else:
            raise ConfigError(f"--lora-modules {spec!r}: expected name=path or a JSON object with name and path")
    return out
