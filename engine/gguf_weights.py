"""A GGUF file's projection weights kept in their block formats (`EngineConfig.quantization="gguf"`), and a
safetensors checkpoint's quantized to such blocks at load (`quantization="int8" | "int4"`, `quantize_model`).

The model still loads from the converted safetensors copy (engine/loader.py: config, tokenizer, norms,
embeddings); as it loads, `GGUFPacker` swaps every decoder projection (q/k/v, o, gate/up, down) and an untied
LM head for the GGUF file's own blocks, layer by layer, read from the header (`engine.gguf_header.gguf_tensors`)
and plain file reads (no dequantization, no mapping), so each `Linear` runs `kernels.quant.quant_linear` on the
file's bytes and its widened weight is dropped before the next layer loads.

Rows: the model fuses q/k/v and gate/up (row concatenation) and keeps q and k rows in the adjacent-pair
rope layout (`model.interleave_rope_rows`); llama.cpp's converter stores a Llama's q and k rows permuted
per head (its `permute`), other families as HF has them. A block row is a whole weight row, so every
such reordering is a row gather of the packed bytes. Which ordering a file uses is not guessed: each
candidate's rows are decoded (exactly: kernels/quant.py), rounded to the model's dtype and compared
with the widened weight loaded from the converted copy, bit for bit; no match (or a format the kernels do not take, or a missing
tensor) and the model stays widened, with the reason for the start-up line.

Not packed: the token embedding (a lookup of a few rows; it stays widened in the model's dtype), norms and
biases (small, fp32 in the file). A tied model's LM head (SmolLM2's) runs on the embedding's blocks
(`model.tied_head_quant`) where their format is one the kernels take.

A mixture of experts' experts are put in blocks as they load (engine.moe, `SparseMoE.expert_blocks`): a
checkpoint's MXFP4 kept (the default on CPU, `experts_packed` describes it), or Q8_0 / Q4_1 under
`--quantization int8 | int4`, whose `quantize_model` then packs the rest (the router stays widened: E outputs,
and the routing decides which weights run). A GGUF file's experts are not kept packed yet (`GGUFPacker` refuses).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from agentrt.engine.moe import SparseMoE
from agentrt.kernels.linear import Linear, on_huge_pages
from agentrt.kernels.quant import FORMATS, QuantWeight, dequantize, quantize

# fused projection of a decoder layer -> the GGUF tensors whose rows it concatenates
_LAYER_PROJECTIONS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


@dataclass(slots=True)
class PackedWeights:
    """What `pack_model` kept packed."""

    formats: Counter  # format name -> tensors of that format
    nbytes: int  # bytes of the packed projection weights
    embedding_packed: bool = False  # the token embedding too (looked up from its blocks), else widened
    widened_bytes: int = 0  # bytes of the weights left widened (norms, biases; the embedding) in the model's dtype

    source: str = "gguf"  # "gguf": the file's blocks; "int8" / "int4": quantized at load (quantize_model);
    # "experts": only a mixture's experts, as the checkpoint ships them (MXFP4; experts_packed)
    expert_formats: Counter = field(default_factory=Counter)  # of the experts among `formats` (per [E, N, K] stack)
    expert_bytes: int = 0  # of the experts among `nbytes`

    def describe(self) -> str:
        """e.g. "gguf Q4_1+Q8_0 kept packed, 96 MB (+ 0 MB widened: norms)", "int4 (Q4_1+Q8_0 blocks of 32) ...",
        "experts MXFP4 kept packed, 1528 MB (+ 2860 MB widened: attention, router, embeddings, LM head, norms)"."""
        experts = "+".join(name for name, _ in self.expert_formats.most_common())
        if self.source == "experts":
            return (f"experts {experts} kept packed, {self.expert_bytes / 1e6:.0f} MB "
                    f"(+ {self.widened_bytes / 1e6:.0f} MB widened: attention, router, embeddings, LM head, norms)")
        names = "+".join(name for name, _ in self.formats.most_common())
        widened = "norms" if self.embedding_packed else "embeddings, norms"
        if self.expert_bytes:
            widened = "router, " + widened
        what = f"gguf {names}" if self.source == "gguf" else f"{self.source} ({names} blocks of 32)"
        of_it = f" ({experts} experts {self.expert_bytes / 1e6:.0f} MB of it)" if self.expert_bytes else ""
        return (f"{what} kept packed, {self.nbytes / 1e6:.0f} MB{of_it} (+ {self.widened_bytes / 1e6:.0f} MB "
                f"widened: {widened})")


def _llama_permuted_order(n: int, heads: int) -> torch.Tensor:
    """For llama.cpp's per-head permutation of q / k rows: GGUF row j holds HF row order[j]."""
    idx = torch.arange(n)
    return idx.reshape(heads, 2, n // heads // 2).transpose(1, 2).reshape(n)


class _Unpackable(Exception):
    """Why the model stays widened (its message is the start-up line's reason)."""


class GGUFPacker:
    """Swaps a model's projections for a GGUF file's blocks as the model loads (`loaded`, the callback of
    `LlamaForCausalLM.load_hf_state_dict`): layer i's projections are matched and swapped once they are in, so no
    layer's widened weights outlive its turn (a Qwen3-4B-shape Q4_K_M file: the load peaked at 8.8 GB with the
    whole bf16 model loaded before packing, 3.4 GB now). What the header tells (a projection that is not plain, a
    missing tensor, a format the kernels do not take) is checked before any weight loads: ValueError, the model
    untouched. Rows that decode to no candidate order raise ValueError midway, some layers already packed: load
    the model again widened (load_model does)."""

    def __init__(self, model, gguf_path: Path):
        from agentrt.engine.gguf_header import gguf_tensors

        self.model, self.path = model, gguf_path
        self.tensors = gguf_tensors(gguf_path)
        self.formats: Counter = Counter()
        self.nbytes = 0
        self.embed: QuantWeight | None = None
        targets = [[(f"layers.{i}.{attr}", getattr(getattr(layer, attr.split(".")[0]), attr.split(".")[1], None),
                     [f"blk.{i}.{name}.weight" for name in names]) for attr, names in _LAYER_PROJECTIONS.items()]
                   for i, layer in enumerate(model.layers)]
        head = [("lm_head", model.lm_head, ["output.weight"])] if model.lm_head is not None else []
        self.targets = {-1: head, **dict(enumerate(targets))}  # by the `loaded` call that swaps them
        every = [t for ts in self.targets.values() for t in ts]
        for where, lin, _ in every:
            if not isinstance(lin, Linear):
                raise ValueError(f"{where} is not a plain projection (a GGUF file's experts are not kept packed "
                                 "yet: quantization='none' widens them)")
        for where, _, names in every:
            for name in names:
                if name not in self.tensors:
                    raise ValueError(f"the GGUF file has no tensor {name!r} for {where}")
                type_id, dims, _ = self.tensors[name]
                if type_id not in FORMATS or len(dims) != 2:
                    raise ValueError(f"{name} has ggml type {type_id}, a format the packed kernels do not take "
                                     f"(they take {', '.join(f[0] for f in FORMATS.values())})")

    def loaded(self, i: int) -> None:
        """Layer i's weights are in (-1: the embedding, final norm and LM head): swap its projections."""
        from agentrt.engine.model import interleave_rope_rows

        if i == -1:
            self._embedding()
        swapped = []
        for where, lin, names in self.targets.pop(i):
            parts, row = [], 0
            try:
                for name in names:
                    type_id, (k, n), offset = self.tensors[name]
                    data = _read_rows(self.path, name, type_id, (n, k), offset)
                    parts.append(_matching_rows(data, type_id, (n, k), lin.weight[row : row + n], name, self.model,
                                                interleave_rope_rows))
                    self.formats[FORMATS[type_id][0]] += 1
                    row += n
                if row != lin.weight.shape[0]:
                    raise _Unpackable(f"{where} has {lin.weight.shape[0]} rows, its GGUF tensors {row}")
            except _Unpackable as e:
                raise ValueError(str(e)) from None
            lin.quant = tuple(_merge_same_format(parts))
            lin.weight = torch.nn.Parameter(torch.empty(0, dtype=lin.weight.dtype), requires_grad=False)
            self.nbytes += sum(p.nbytes for p in lin.quant)
            swapped.append(lin)
        # the layer's blocks in 2 MB pages (one mapping a layer): a decode step streams them all, and in 4 KB pages
        # every page is a TLB walk and a stop for the hardware prefetcher. Qwen3-4B-shape Q4_K_M, one stream on a
        # 2-core Xeon VM, processes in turn: 5.6-5.8 -> 6.0-6.4 tok/s (4.9-5.0 -> 5.5-5.7 in A/B rounds within
        # one process); where huge pages cannot be had the copies are plain pages
        homed = iter(on_huge_pages([p.data for lin in swapped for p in lin.quant]))
        for lin in swapped:
            lin.quant = tuple(replace(p, data=next(homed)) for p in lin.quant)

    def _embedding(self) -> None:
        model = self.model
        embed = _embedding(model, self.path, self.tensors.get("token_embd.weight"))
        if embed is not None:
            if model.lm_head is None:  # a tied head streams it (as the projections, below)
                embed = replace(embed, data=on_huge_pages([embed.data])[0])
            self.formats[embed.format_name] += 1
            self.nbytes += embed.nbytes
            model.embed_quant = embed
            model.embed_tokens.weight = torch.nn.Parameter(torch.empty(0, dtype=model.embed_tokens.weight.dtype),
                                                           requires_grad=False)
        model.tied_head_quant = (embed,) if embed is not None and model.lm_head is None else None
        self.embed = embed

    def finish(self) -> PackedWeights:
        """What was kept packed, once every layer was `loaded`."""
        if self.targets:
            raise ValueError(f"GGUFPacker.finish: layers {sorted(self.targets)} were never loaded")
        self.model.quantized = True
        return PackedWeights(self.formats, self.nbytes, embedding_packed=self.embed is not None)


def pack_model(model, gguf_path: Path) -> PackedWeights:
    """`GGUFPacker` over a model already loaded (from the converted fp32 copy of `gguf_path`, in any dtype)."""
    packer = GGUFPacker(model, gguf_path)
    for i in [-1, *range(len(model.layers))]:
        packer.loaded(i)
    return packer.finish()


# --quantization -> the block format of the projections (the token embedding, and a tied LM head on it, take Q8_0)
QUANTIZE_FORMATS = {"int8": "Q8_0", "int4": "Q4_1"}


def quantize_model(model, scheme: str) -> PackedWeights:
    """Weight-only `--quantization int8 | int4` of a model loaded from safetensors: every decoder projection and an
    untied LM head quantized to blocks of 32 weights with fp16 scales (int8: Q8_0, symmetric; int4: Q4_1, a scale
    and a minimum per block) and run by the same packed kernels as a GGUF file's; the token embedding (and a tied
    LM head on it) in Q8_0 (at 4 bits the embedding's and head's error is the largest single loss; llama.cpp's Q4
    files keep them at 6-8 bits too). Their widened weights are dropped. Norms and biases stay widened."""
    if scheme not in QUANTIZE_FORMATS:
        raise ValueError(f"quantize_model: scheme must be one of {', '.join(QUANTIZE_FORMATS)}, got {scheme!r}")
    fmt = QUANTIZE_FORMATS[scheme]
    lins = []
    for i, layer in enumerate(model.layers):
        moe = layer.mlp if isinstance(layer.mlp, SparseMoE) else None
        if moe is not None and moe.w13_quant is None:
            raise ValueError(f"--quantization {scheme}: layers.{i}'s experts were loaded widened (load the model with "
                             f"SparseMoE.expert_blocks = {fmt!r}: engine.loader.load_model(quantize={scheme!r}))")
        lins += [(f"layers.{i}.{attr}", getattr(getattr(layer, attr.split(".")[0]), attr.split(".")[1]))
                 for attr in _LAYER_PROJECTIONS if moe is None or not attr.startswith("mlp.")]
        if moe is not None and moe.shared_gate_up is not None:
            lins += [(f"layers.{i}.mlp.shared_gate_up", moe.shared_gate_up),
                     (f"layers.{i}.mlp.shared_down", moe.shared_down)]
    if model.lm_head is not None:
        lins.append(("lm_head", model.lm_head))
    for where, lin in lins:
        if not isinstance(lin, Linear):
            raise ValueError(f"--quantization {scheme}: {where} is not a plain projection")
        if lin.weight.shape[1] % 32:
            raise ValueError(f"--quantization {scheme}: {where} takes {lin.weight.shape[1]} inputs, not a multiple "
                             "of the 32-weight blocks")
    formats: Counter = Counter()
    nbytes = 0
    for _, lin in lins:
        qw = quantize(lin.weight.detach(), fmt)
        lin.quant = (qw,)
        lin.weight = torch.nn.Parameter(torch.empty(0, dtype=lin.weight.dtype), requires_grad=False)
        formats[fmt] += 1
        nbytes += qw.nbytes
    embed = None
    if model.embed_tokens.weight.shape[1] % 32 == 0:
        embed = quantize(model.embed_tokens.weight.detach(), "Q8_0")
        model.embed_quant = embed
        model.embed_tokens.weight = torch.nn.Parameter(torch.empty(0, dtype=model.embed_tokens.weight.dtype),
                                                       requires_grad=False)
        formats["Q8_0"] += 1
        nbytes += embed.nbytes
    model.tied_head_quant = (embed,) if embed is not None and model.lm_head is None else None
    model.quantized = True
    experts = experts_packed(model)
    if experts is not None:
        formats.update(experts.expert_formats)
        nbytes += experts.expert_bytes
    return PackedWeights(formats, nbytes, embedding_packed=embed is not None, source=scheme,
                         expert_formats=experts.expert_formats if experts else Counter(),
                         expert_bytes=experts.expert_bytes if experts else 0)


def experts_packed(model) -> PackedWeights | None:
    """What a mixture's experts kept in blocks are (engine.moe, `SparseMoE.expert_blocks`), or None when no
    experts are: `source="experts"` (the rest of the model widened)."""
    stacks = [q for layer in model.layers if isinstance(layer.mlp, SparseMoE) for q in layer.mlp.packed_experts()]
    if not stacks:
        return None
    formats = Counter(q.format_name for q in stacks)
    nbytes = sum(q.nbytes for q in stacks)
    return PackedWeights(Counter(formats), nbytes, source="experts", expert_formats=formats, expert_bytes=nbytes)


def _matching_rows(data: torch.Tensor, type_id: int, shape: tuple[int, int], want: torch.Tensor, name: str, model,
                   interleave_rope_rows) -> QuantWeight:
    """The rows of GGUF tensor `data` in the order of `want` (the widened rows they must decode to)."""
    n, _ = shape
    a = model.args
    orders = [None]
    if name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = a.num_heads if name.endswith("attn_q.weight") else a.num_kv_heads
        ours_to_hf = interleave_rope_rows(torch.arange(n).unsqueeze(1), heads, a.head_dim, a.rotary_dim or a.head_dim)
        ours_to_hf = ours_to_hf.squeeze(1).long()
        gguf_of_hf_permuted = torch.argsort(_llama_permuted_order(n, heads))
        orders = [ours_to_hf, gguf_of_hf_permuted[ours_to_hf]]
    for order in orders:
        qw = QuantWeight(data if order is None else data[order].contiguous(), type_id, shape)
        if _decodes_to(qw, want):
            return qw
    raise _Unpackable(f"the rows of {name} do not decode to the converted weights (an unknown row layout)")


def _embedding(model, gguf_path: Path, info) -> QuantWeight | None:
    """The file's token embedding blocks, where their format is one the kernels take and they decode to the
    embedding the model loaded (else the model keeps that widened copy)."""
    if info is None or info[0] not in FORMATS or len(info[1]) != 2:
        return None
    type_id, (k, n), offset = info
    try:
        qw = QuantWeight(_read_rows(gguf_path, "token_embd.weight", type_id, (n, k), offset), type_id, (n, k))
    except _Unpackable:
        return None
    return qw if _decodes_to(qw, model.embed_tokens.weight) else None


def _read_rows(gguf_path: Path, name: str, type_id: int, shape: tuple[int, int], offset: int) -> torch.Tensor:
    """A GGUF tensor's bytes [N, K / block * block bytes] uint8, read with file reads (a mapping of the file
    would leave every touched page counted in the process's resident memory)."""
    _, block, nbytes = FORMATS[type_id]
    n, k = shape
    if k % block:
        raise _Unpackable(f"{name}: {k} weights a row is not a whole number of {block}-weight blocks")
    out = torch.empty(n, k // block * nbytes, dtype=torch.uint8)
    with open(gguf_path, "rb") as f:
        f.seek(offset)
        got = f.readinto(memoryview(out.view(-1).numpy()))
    if got != out.numel():
        raise _Unpackable(f"{name} is truncated in the GGUF file ({got} of {out.numel()} bytes)")
    return out


def _decodes_to(qw: QuantWeight, want: torch.Tensor, rows: int = 4096) -> bool:
    """Whether `qw` decodes to `want` (the widened weight, fp32 rounded to its dtype) bit for bit; in slices of
    `rows` rows, so that no whole fp32 copy of a large weight is made."""
    data = qw.data
    for r in range(0, qw.shape[0], rows):
        part = QuantWeight(data[r : r + rows], qw.type_id, (min(rows, qw.shape[0] - r), qw.shape[1]))
        if not torch.equal(dequantize(part).to(want.dtype), want[r : r + rows]):
            return False
    return True


def _merge_same_format(parts: list[QuantWeight]) -> list[QuantWeight]:
    """Neighbouring parts of one format as one weight (q, k, v of one format: one kernel call)."""
    out: list[QuantWeight] = []
    for p in parts:
        if out and out[-1].type_id == p.type_id:
            prev = out.pop()
            p = QuantWeight(torch.cat([prev.data, p.data]), p.type_id, (prev.shape[0] + p.shape[0], p.shape[1]))
        out.append(p)
    return out
