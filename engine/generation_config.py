"""The model's recommended sampling defaults (vLLM's `--generation-config`): what its creator put in
`generation_config.json` (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), used for
every field a request leaves unset. vLLM's default, "auto", reads the checkpoint's file; "vllm" ignores
it (the engine's own defaults: temperature 1, no truncation); a directory path reads the file there.
`override_generation_config` ({field: value}) goes on top, e.g. `{"temperature": 0.5}`.

A model without the file (a GGUF file, most random test models) has no defaults: nothing changes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config.json field -> SamplingParams field (vLLM's list)
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}  # HF's "off"


def generation_defaults(model_path: Path, source: str | None = "auto",
                        override: dict[str, Any] | None = None) -> dict[str, Any]:
    """SamplingParams defaults for `model_path` (a directory or a .gguf file); ValueError naming the file
    and field when a value is not one SamplingParams takes."""
    from agentrt.engine.sampling_params import SamplingParams

    if source is None:
        source = "auto"
    if not isinstance(source, str) or not source:
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got {source!r}")
    defaults: dict[str, Any] = {}
    where = "override_generation_config"
    if source != "vllm":
        folder = Path(model_path) if source == "auto" else Path(source)
        if source != "auto" and not folder.is_dir():
            raise ValueError(f"generation_config {source!r} is not a directory")
        file = folder / "generation_config.json" if folder.is_dir() else None
        if file is not None and file.is_file():
            where = str(file)
            try:
                cfg = json.loads(file.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{file} cannot be read: {e}") from None
            if not isinstance(cfg, dict):
                raise ValueError(f"{file} is not a JSON object")
            for key, field in FIELDS.items():
                value = cfg.get(key)
                if value is not None and value != _NEUTRAL.get(key):  # HF writes "off" values too
                    defaults[field] = value
        elif source != "auto":
            raise ValueError(f"generation_config {source!r} has no generation_config.json")
    if override:
        if not isinstance(override, dict):
            raise ValueError(f"override_generation_config must be a JSON object, got {override!r}")
        unknown = [k for k in override if k not in FIELDS]
        if unknown:
            raise ValueError(f"override_generation_config: unknown field {unknown[0]!r}; expected one of "
                             f"{', '.join(FIELDS)}")
        defaults.update({FIELDS[k]: v for k, v in override.items()})
    if "top_k" in defaults and defaults["top_k"] == 0:
        defaults["top_k"] = -1  # HF's "off"
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the sampling defaults from {where} are not valid: {e}") from None
    return defaults
