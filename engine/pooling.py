"""Embeddings: a prompt's final hidden states pooled into one vector (vLLM's pooling, `LLM.embed`).

A pooling request computes its prompt and ends there: no token is sampled, and the LM head never
runs for it. The vector comes from the rows after the model's final norm (what HF's base model
returns as `last_hidden_state`), pooled one of three ways:

- `last`: the last prompt token's row (decoder embedding models such as Qwen3-Embedding; the prefix
  cache still serves every earlier position, the last one is always computed);
- `mean`: the mean of every prompt row (the request then reads no cached prefix: each row is needed);
- `cls`: the first prompt token's row (likewise computed, not cached).

Then `dimensions` keeps the first D values (Matryoshka embeddings), and `normalize` scales the vector
to unit L2 norm, in that order, as vLLM and OpenAI's `dimensions` do.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from agentrt.engine.errors import InvalidRequestError, InvalidRequestTypeError, show_value

POOLING_METHODS = ("last", "mean", "cls")
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


def default_method(model_dir: str | os.PathLike) -> str:
    """The pooling a checkpoint declares (sentence-transformers' `modules.json` and its Pooling module's
    config, as embedding models such as Qwen3-Embedding ship), else "last" (vLLM's default for decoders)."""
    root = Path(model_dir)
    try:
        modules = json.loads((root / "modules.json").read_text())
        folder = next(m["path"] for m in modules if m.get("type", "").endswith("Pooling"))
        cfg = json.loads((root / folder / "config.json").read_text())
    except (OSError, ValueError, StopIteration, KeyError, TypeError):
        return "last"
    return next((method for key, method in _ST_MODES.items() if cfg.get(key)), "last")


@dataclass(slots=True)
class PoolingParams:
    """How a pooling request turns its prompt into a vector; checked on construction (a bad field
    raises InvalidRequestError / InvalidRequestTypeError naming it)."""

    method: str = "last"  # POOLING_METHODS
    normalize: bool = True  # unit L2 norm (after `dimensions`)
    dimensions: int | None = None  # keep the first D values (1 <= D <= hidden size, checked at add)

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or self.method not in POOLING_METHODS:
            raise InvalidRequestError(f"PoolingParams.method must be one of {', '.join(POOLING_METHODS)}, "
                                      f"got {show_value(self.method)}", parameter="pooling.method", value=self.method)
        if not isinstance(self.normalize, bool):
            raise InvalidRequestTypeError(f"PoolingParams.normalize must be a bool, got {show_value(self.normalize)}",
                                          parameter="pooling.normalize", value=self.normalize)
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InvalidRequestError(f"PoolingParams.dimensions must be None or an int >= 1, "
                                      f"got {show_value(self.dimensions)}", parameter="pooling.dimensions",
                                      value=self.dimensions)

    @property
    def reads_cache(self) -> bool:
        """Whether a cached prefix may serve the prompt (only the last row is needed)."""
        return self.method == "last"

    def rows(self, start: int, count: int, num_prompt: int) -> tuple[int, int] | None:
        """Of a chunk computing prompt positions start .. start + count - 1, the (offset, count) of the
        rows this pooling reads; None when it reads none of them."""
        if self.method == "last":
            return (num_prompt - 1 - start, 1) if start + count == num_prompt else None
        if self.method == "cls":
            return (0, 1) if start == 0 else None
        return 0, count

    def finish(self, pooled: torch.Tensor, num_prompt: int) -> list[float]:
        """The embedding from the pooled rows' fp32 sum [hidden]."""
        v = pooled / num_prompt if self.method == "mean" else pooled
        if self.dimensions is not None:
            v = v[: self.dimensions]
        if self.normalize:
            v = v / v.norm().clamp_min(1e-12)
        return v.tolist()


@dataclass(slots=True)
class ClassificationOutput:
    """vLLM's classification output: one prompt's class probabilities (a *ForSequenceClassification model)."""

    request_id: str
    probs: list[float]  # per class, softmax of the score head on the last token's final hidden state
    label: str  # the most likely class's name (the config's id2label), else its index

    @property
    def num_classes(self) -> int:
        return len(self.probs)


def classifications(model, hf_config, request_ids: list[str], pooled: list[list[float]]) -> list[ClassificationOutput]:
    """The class probabilities and labels of last-token final-norm hidden states (`pooled`, one per request),
    through `model`'s score head (engine.model `classify`); labels by the config's id2label, else indices."""
    import torch

    probs = model.classify(torch.tensor(pooled)).tolist()
    id2label = getattr(hf_config, "id2label", None) or {}
    labels = [str(id2label.get(i, id2label.get(str(i), i))) for i in range(model.args.num_labels)]
    return [ClassificationOutput(rid, p, labels[max(range(len(p)), key=p.__getitem__)])
            for rid, p in zip(request_ids, probs, strict=True)]
