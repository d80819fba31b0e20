"""LoRA adapters: vLLM's multi-LoRA serving, on the base model's weights as they are.

    llm = LLM(model, enable_lora=True)
    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))

An adapter is a PEFT directory (`adapter_config.json` and `adapter_model.safetensors` or `.bin`) with
LoRA pairs on any of q/k/v/o_proj and gate/up/down_proj. It is loaded once, on the caller's thread, when
a request first names it (a bad one is an InvalidRequestError naming the file and what is wrong), into
the model's fused layout: one A [r_q + r_k + r_v, hidden] and one block B [q + 2 kv, r_q + r_k + r_v] for
the fused qkv projection (B's q and k rows in the rope layout of engine/model.py, the scaling folded into
B), likewise gate/up. The weights are never merged: one batch mixes requests of any adapters and of
the base model, each projection adding `(x_rows @ A^T) @ B^T` to its adapter's rows (LoRABatch).

Prefix-cache block hashes include the adapter (engine/request.py `Request.hash_extra`), so the K/V one
adapter computed is never reused by another. A request holds its adapter object; the engine keeps the
`max_loras` most recently used adapters loaded, and an id loaded again with another name or path is an
error (vLLM's rule: an int id names one adapter).
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from agentrt.engine.errors import InvalidRequestError, InvalidRequestTypeError, show_value

# PEFT module name -> (our fused projection, its part)
_MODULES = {"q_proj": ("qkv", "q"), "k_proj": ("qkv", "k"), "v_proj": ("qkv", "v"), "o_proj": ("o", "o"),
            "gate_proj": ("gate_up", "gate"), "up_proj": ("gate_up", "up"), "down_proj": ("down", "down")}
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight")


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's LoRARequest: a name clients use, an int id (>= 1) naming one adapter, and its directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None  # accepted for vLLM compatibility; not checked

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestTypeError(f"LoRARequest.lora_name must be a non-empty str, got {show_value(self.lora_name)}",
                                          parameter="lora_request.lora_name", value=self.lora_name)
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidRequestError(f"LoRARequest.lora_int_id must be an int >= 1, got {show_value(self.lora_int_id)}",
                                      parameter="lora_request.lora_int_id", value=self.lora_int_id)
        if not isinstance(self.lora_path, (str, Path)) or not str(self.lora_path):
            raise InvalidRequestTypeError(f"LoRARequest.lora_path must be a directory path, got {show_value(self.lora_path)}",
                                          parameter="lora_request.lora_path", value=self.lora_path)


@dataclass(eq=False, slots=True)
class LoRAAdapter:
    """One adapter's weights in the model's layout: per layer, fused projection -> (A [R, in], B [out, R])."""

    request: LoRARequest
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    rank: int  # the largest rank of its pairs
    dtype: torch.dtype  # of its weights: the model's
    hash_key: str = field(init=False)  # what prefix-cache hashes mix in

    def __post_init__(self) -> None:
        self.hash_key = f"lora{self.request.lora_int_id}"

    @property
    def name(self) -> str:
        return self.request.lora_name

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for pair in layer.values() for t in pair)


MASK_MAX_ROWS = 64  # up to this many rows in a forward (decode steps), an adapter's rows are picked by a 0/1
# mask over all rows rather than gathered and scattered: three small ops instead of four, no copies


class LoRABatch:
    """Which rows of one forward belong to which adapter; the model's projections call `apply`."""

    def __init__(self, groups: list[tuple[LoRAAdapter, torch.Tensor | None]]) -> None:
        self.groups = groups  # (adapter, None for every row, else its rows: a [T, 1] 0/1 mask or [n] indices)

    @classmethod
    def for_rows(cls, adapters: list[LoRAAdapter | None], rows_per: list[int], device: torch.device) -> LoRABatch | None:
        """The batch of a forward whose i-th request has `rows_per[i]` consecutive rows and adapter
        `adapters[i]` (None: the base model); None when no request has one."""
        if all(a is None for a in adapters):
            return None
        spans: dict[int, tuple[LoRAAdapter, list[range]]] = {}
        start = 0
        for a, n in zip(adapters, rows_per, strict=True):
            if a is not None:
                spans.setdefault(id(a), (a, []))[1].append(range(start, start + n))
            start += n
        groups: list[tuple[LoRAAdapter, torch.Tensor | None]] = []
        for a, ranges in spans.values():
            if len(spans) == 1 and sum(map(len, ranges)) == start:
                groups.append((a, None))
            elif start <= MASK_MAX_ROWS:
                mask = torch.zeros(start, 1, dtype=a.dtype)
                for r in ranges:
                    mask[r.start : r.stop] = 1
                groups.append((a, mask.to(device)))
            else:
                idx = torch.tensor([i for r in ranges for i in r], dtype=torch.long)
                groups.append((a, idx.to(device)))
        return cls(groups)

    def apply(self, layer: int, proj: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows] += (x[rows] @ A^T) @ B^T for each adapter with a pair on (layer, proj)."""
        for adapter, rows in self.groups:
            pair = adapter.layers[layer].get(proj)
            if pair is None:
                continue
            a, b = pair
            if rows is None:
                out.addmm_(x @ a.t(), b.t())
            elif rows.dim() == 2:  # a mask: every row through A, the others' zeroed before B
                out.addmm_((x @ a.t()).mul_(rows), b.t())
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())


class LoRASlot:
    """The model's handle on the current forward's LoRABatch (None: no adapter in this forward)."""

    __slots__ = ("batch",)

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None

    @contextlib.contextmanager
    def use(self, adapters: list[LoRAAdapter | None], rows_per: list[int], device: torch.device) -> Iterator[None]:
        """The forward inside runs with these requests' adapters (`LoRABatch.for_rows`), none after it."""
        self.batch = LoRABatch.for_rows(adapters, rows_per, device)
        try:
            yield
        finally:
            self.batch = None


def _bad(req: LoRARequest, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter {req.lora_name!r} at {str(req.lora_path)!r}: {what}",
                               parameter="lora_request", value=req)


def _read_config(req: LoRARequest) -> dict:
    path = Path(req.lora_path) / "adapter_config.json"
    if not Path(req.lora_path).is_dir():
        raise _bad(req, "not a directory")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _bad(req, "no adapter_config.json (a PEFT LoRA adapter directory has one)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(req, f"adapter_config.json cannot be read: {e}") from None
    if not isinstance(cfg, dict):
        raise _bad(req, "adapter_config.json is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _bad(req, f"peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    for flag in ("use_dora", "fan_in_fan_out"):
        if cfg.get(flag):
            raise _bad(req, f"{flag}=true is not supported")
    if cfg.get("modules_to_save"):
        raise _bad(req, f"modules_to_save {cfg['modules_to_save']!r} is not supported (only LoRA pairs)")
    if cfg.get("bias", "none") != "none":
        raise _bad(req, f"bias={cfg['bias']!r} is not supported (only 'none')")
    alpha = cfg.get("lora_alpha", cfg.get("r", 8))
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise _bad(req, f"lora_alpha must be a positive number, got {alpha!r}")
    return cfg


def _read_weights(req: LoRARequest) -> dict[str, torch.Tensor]:
    d = Path(req.lora_path)
    try:
        if (d / "adapter_model.safetensors").is_file():
            from safetensors.torch import load_file

            return load_file(str(d / "adapter_model.safetensors"))
        if (d / "adapter_model.bin").is_file():
            return torch.load(d / "adapter_model.bin", map_location="cpu", weights_only=True)
    except Exception as e:  # a corrupt file: say which and why, whatever the loader raised
        raise _bad(req, f"the adapter weights cannot be read: {type(e).__name__}: {e}") from None
    raise _bad(req, "no adapter_model.safetensors or adapter_model.bin")


def _alpha(cfg: dict, key: str) -> float:
    for pattern, value in (cfg.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?{pattern}", key.rsplit(".lora_", 1)[0]):
            return float(value)
    return float(cfg.get("lora_alpha", cfg.get("r", 8)))


def load_adapter(req: LoRARequest, args, dtype: torch.dtype, device: torch.device | str, max_rank: int,
                 permute_rope_rows) -> LoRAAdapter:
    """Read and check a PEFT adapter against the model's shapes (`args`: engine.model_args.ModelArgs) and
    lay it out for LoRABatch. `permute_rope_rows(w, heads, head_dim)` puts q/k rows in the model's
    rope layout. InvalidRequestError naming the adapter and the problem when it cannot serve."""
    cfg = _read_config(req)
    sd = _read_weights(req)
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    shapes = {"q": (args.hidden_size, q), "k": (args.hidden_size, kv), "v": (args.hidden_size, kv),
              "o": (q, args.hidden_size), "gate": (args.hidden_size, args.intermediate_size),
              "up": (args.hidden_size, args.intermediate_size), "down": (args.intermediate_size, args.hidden_size)}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}  # (layer, part) -> {"A": ..., "B": ...}
    for key, t in sd.items():
        m = _KEY.fullmatch(key)
        if m is None or m.group(2) not in _MODULES:
            raise _bad(req, f"weight {key!r} is not a LoRA pair of q/k/v/o_proj or gate/up/down_proj "
                            "(embedding, LM head and other modules are not supported)")
        layer, part = int(m.group(1)), _MODULES[m.group(2)][1]
        if layer >= args.num_layers:
            raise _bad(req, f"weight {key!r} is for layer {layer}, the model has {args.num_layers}")
        if part in ("gate", "up", "down") and args.moe is not None and layer in args.moe.sparse_layers:
            raise _bad(req, f"weight {key!r} is for layer {layer}'s MLP, a mixture of experts here: LoRA on experts "
                            "is not supported (attention projections are)")
        if t.dim() != 2 or not t.is_floating_point():
            raise _bad(req, f"weight {key!r} must be a 2-D float tensor, got {tuple(t.shape)} {t.dtype}")
        entry = pairs.setdefault((layer, part), {})
        entry[m.group(3)] = t
        entry.setdefault("alpha", _alpha(cfg, key))
    if not pairs:
        raise _bad(req, "the adapter has no LoRA weights")
    rank = 0
    rslora = bool(cfg.get("use_rslora"))
    scaled: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, part), e in sorted(pairs.items()):
        where = f"layer {layer} {part}_proj"
        if "A" not in e or "B" not in e:
            have, missing = ("A", "B") if "A" in e else ("B", "A")
            raise _bad(req, f"{where} has lora_{have} but not lora_{missing}")
        a, b = e["A"], e["B"]
        fan_in, fan_out = shapes[part]
        r = a.shape[0]
        if a.shape[1] != fan_in or b.shape != (fan_out, r):
            raise _bad(req, f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the model "
                            f"(want [r, {fan_in}] and [{fan_out}, r])")
        if r > max_rank:
            raise _bad(req, f"{where} has rank {r}, above max_lora_rank {max_rank}")
        rank = max(rank, r)
        scale = e["alpha"] / (r**0.5 if rslora else r)
        b = b.float() * scale
        if part in ("q", "k"):
            b = permute_rope_rows(b, args.num_heads if part == "q" else args.num_kv_heads, args.head_dim)
        scaled[(layer, part)] = (a.float(), b)
    fused = {"qkv": (("q", q), ("k", kv), ("v", kv)), "o": (("o", args.hidden_size),),
             "gate_up": (("gate", args.intermediate_size), ("up", args.intermediate_size)),
             "down": (("down", args.hidden_size),)}
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    for layer in range(args.num_layers):
        mods = {}
        for proj, parts in fused.items():
            present = [(p, size, scaled.get((layer, p))) for p, size in parts]
            if all(w is None for _, _, w in present):
                continue
            ranks = sum(w[0].shape[0] for _, _, w in present if w is not None)
            a_all = torch.cat([w[0] for _, _, w in present if w is not None])
            b_all = torch.zeros(sum(size for _, size, _ in present), ranks)
            row = col = 0
            for _, size, w in present:
                if w is not None:
                    r = w[0].shape[0]
                    b_all[row : row + size, col : col + r] = w[1]
                    col += r
                row += size
            mods[proj] = (a_all.to(device=device, dtype=dtype).contiguous(),
                          b_all.to(device=device, dtype=dtype).contiguous())
        layers.append(mods)
    return LoRAAdapter(req, layers, rank, dtype)


class LoRARegistry:
    """The adapters loaded, by int id, most recently used last; at most `capacity` (requests still
    holding an evicted one keep it until they end). Thread-safe: callers load, the engine reads requests."""

    def __init__(self, capacity: int, load) -> None:
        self.capacity = capacity
        self._load = load  # LoRARequest -> LoRAAdapter
        self._by_id: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, req: LoRARequest | LoRAAdapter) -> LoRAAdapter:
        if isinstance(req, LoRAAdapter):
            return req
        if not isinstance(req, LoRARequest):
            raise InvalidRequestTypeError(f"lora_request must be an engine.LoRARequest or None, got {show_value(req)}",
                                          parameter="lora_request", value=req)
        with self._lock:
            have = self._by_id.get(req.lora_int_id)
            if have is not None:
                if (have.request.lora_name, str(have.request.lora_path)) != (req.lora_name, str(req.lora_path)):
                    raise InvalidRequestError(
                        f"LoRA id {req.lora_int_id} already names adapter {have.request.lora_name!r} at "
                        f"{str(have.request.lora_path)!r}, not {req.lora_name!r} at {str(req.lora_path)!r}",
                        parameter="lora_request", value=req)
                self._by_id.move_to_end(req.lora_int_id)
                return have
        adapter = self._load(req)  # outside the lock: file reads
        with self._lock:
            self._by_id[req.lora_int_id] = adapter
            self._by_id.move_to_end(req.lora_int_id)
            while len(self._by_id) > self.capacity:
                self._by_id.popitem(last=False)
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        with self._lock:
            return self._by_id.pop(lora_int_id, None) is not None

    def loaded(self) -> list[LoRARequest]:
        with self._lock:
            return [a.request for a in self._by_id.values()]
