"""Mixture-of-experts pieces: routing (top-k of a router's logits), grouping (the step's token-expert
assignments sorted by expert) and the grouped expert projection, `grouped_linear`.

A step's T tokens each choose k experts; the T * k assignments are sorted by expert (stable, so an
expert's rows keep token order), the token rows gathered in that order, and each expert's weight
multiplies all of its rows in one GEMM: y[r] = x[r] @ W[e(r)].T (+ b[e(r)]), expert e's rows at
offsets[e] .. offsets[e + 1]. Per step every expert's weight is read at most once, whatever number of
tokens picked it; an expert nobody picked is not read at all.

Paths:
- CPU, fp32 or bf16, C++ kernels built (kernels/cpu.py, kernels/csrc/moe.h): one call over all experts,
  every (expert, panel) pair a work item of one parallel loop, from per-expert weights packed once in
  `packed_linear`'s panels (`ExpertPackCache`; the packed copy costs the weights' memory a second time
  unless the caller drops the weights for a placeholder, `ExpertPackCache.adopt`).
- Elsewhere (GPU, other dtypes, no compiler): torch, one `x @ W.T` per expert that has rows (the
  offsets are read on the host once per call); on CUDA in bf16 `torch._grouped_mm` where this torch has it,
  all experts in one launch.
`grouped_linear_ref` is the float64 reference the tests hold both against.

Experts kept in a GGUF block format (`kernels.quant.QuantExperts`: Q8_0 / Q4_1 of `--quantization int8|int4`,
gpt-oss's MXFP4) run through `grouped_quant_linear`: on CPU with the C++ kernels one call, every (expert with rows,
16 weight rows) a work item, each run by `quant_linear`'s own per-panel code, so a row's output is bit for bit what
`quant_linear` gives it with its expert's weight (a bf16 x on AVX512-BF16 by the blocks' integers times x,
kernels/csrc/quant_bf16.h; on AVX2 widened to fp32 in registers). Without the kernels: `quant_linear` per expert
with rows. `grouped_quant_linear_ref` is its float64 reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agentrt.kernels import cpu
from agentrt.kernels.linear import PANEL, PANEL_BF16, PackCache, _version_key
from agentrt.kernels.quant import QuantExperts, dequantize_ref, quant_linear


def route_topk(logits: torch.Tensor, top_k: int, *, renormalize: bool,
               softmax_after_topk: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The k experts of each token and their weights from router logits [T, E] -> (weights [T, k] fp32,
    ids [T, k] int64), highest first.

    Softmax over all experts, then the top k, divided by their sum when `renormalize` (Mixtral,
    Qwen3-MoE's `norm_topk_prob`); or with `softmax_after_topk` the top k logits, then a softmax over
    them (gpt-oss: the same weights as renormalizing, computed in the logits' dtype as it does)."""
    if not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"top_k {top_k} must be between 1 and the {logits.shape[-1]} experts")
    if softmax_after_topk:
        values, ids = torch.topk(logits, top_k, dim=-1)
        return values.softmax(dim=-1).float(), ids
    probs = logits.float().softmax(dim=-1)
    values, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        values = values / values.sum(dim=-1, keepdim=True)
    return values, ids


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignments ids [T, k] (expert of each token's choice) -> (order [T * k] int64: flat assignment
    indices sorted by expert, stable; offsets [E + 1] int64: expert e's assignments are
    order[offsets[e] : offsets[e + 1]]). The token of flat assignment i is i // k."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=ids.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return order, offsets


def pack_expert_weights(weight: torch.Tensor) -> torch.Tensor:
    """Per-expert weights [E, N, K] -> the packed panels of `packed_linear` per expert: fp32
    [E, ceil(N / 16), K, 16], bf16 [E, ceil(N / 32), ceil(K / 2), 32, 2] (rows past N and a last odd k
    zero)."""
    e, n, k = weight.shape
    w = weight.detach()
    if weight.dtype == torch.bfloat16:
        panels, pairs = -(-n // PANEL_BF16), -(-k // 2)
        w = F.pad(w, (0, 2 * pairs - k, 0, panels * PANEL_BF16 - n))
        return w.view(e, panels, PANEL_BF16, pairs, 2).permute(0, 1, 3, 2, 4).contiguous()
    panels = -(-n // PANEL)
    w = F.pad(w, (0, 0, 0, panels * PANEL - n))
    return w.reshape(e, panels, PANEL, k).transpose(2, 3).contiguous()


class ExpertPackCache(PackCache):
    """`PackCache` for a stack of expert weights [E, N, K] (and their biases [E, N] in fp32).

    `adopt` lets the packed copy serve alone: the caller swaps the weight for a placeholder of its shape
    (`expert_placeholder`, one element) and the cache takes the placeholder as the packed copy's source,
    so the experts stay in memory once, not twice; a later change of the weight cannot be repacked and
    is refused, as is any path that would read the placeholder (`grouped_linear` off the C++ kernels)."""

    __slots__ = ("source_freed",)

    def __init__(self):
        super().__init__()
        self.source_freed = False

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = _version_key(weight)
        if key != self.key:
            if self.source_freed:
                raise RuntimeError(f"expert weights {list(weight.shape)} were freed once packed (SparseMoE."
                                   "free_unpacked); a changed weight cannot be repacked: load the model again")
            self.packed, self.key = pack_expert_weights(weight), key
        return self.packed

    def adopt(self, placeholder: torch.Tensor) -> None:
        """Serve the current packed copy for `placeholder`, which now stands where its weight was."""
        if self.packed is None:
            raise RuntimeError("ExpertPackCache.adopt before the weight was packed")
        self.key, self.source_freed = _version_key(placeholder), True


def expert_placeholder(weight: torch.Tensor) -> torch.Tensor:
    """A tensor of `weight`'s shape, dtype and device holding one zero (every stride 0): what stands in for
    expert weights whose packed copy serves alone (`ExpertPackCache.adopt`)."""
    return weight.new_zeros(()).expand(weight.shape)


def grouped_linear_ref(x: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference, in float64: row r of x [M, K] times the weight [E, N, K] of the expert whose range
    offsets [E + 1] holds r -> [M, N] float64."""
    expert = torch.searchsorted(offsets[1:], torch.arange(x.shape[0], device=x.device), right=True)
    w = weight.double()[expert]  # [M, N, K]
    y = torch.einsum("mk,mnk->mn", x.double(), w)
    return y if bias is None else y + bias.double()[expert]


def _check(x: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"grouped_linear: x [M, K] and weight [E, N, K] expected, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if offsets.shape != (weight.shape[0] + 1,):
        raise ValueError(f"grouped_linear: offsets [E + 1] = [{weight.shape[0] + 1}] expected, got {tuple(offsets.shape)}")
    if bias is not None and bias.shape != weight.shape[:2]:
        raise ValueError(f"grouped_linear: bias [E, N] = {list(weight.shape[:2])} expected, got {tuple(bias.shape)}")


def grouped_linear(x: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   pack_cache: ExpertPackCache | None = None) -> torch.Tensor:
    """x [M, K] (rows sorted by expert), offsets [E + 1] int64 (expert e's rows at offsets[e] ..
    offsets[e + 1], offsets[E] = M), weight [E, N, K] (nn.Linear layout per expert), bias [E, N] or
    None -> [M, N] in x's dtype. `pack_cache` (owned by the caller, one per weight) enables the C++ path
    on CPU."""
    _check(x, offsets, weight, bias)
    if (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and weight.dtype == x.dtype
            and pack_cache is not None and not torch.is_grad_enabled() and (ops := cpu.ops()) is not None):
        b = None if bias is None else pack_cache.get_bias_f32(bias)
        return ops.grouped_linear(x.contiguous(), offsets.contiguous(), pack_cache.get(weight), b, weight.shape[1])
    if pack_cache is not None and pack_cache.source_freed:
        raise RuntimeError(f"grouped_linear: the expert weights {list(weight.shape)} were freed once packed and only "
                           f"the C++ kernels read the packed copy (here: {x.device.type}, {x.dtype}, weight "
                           f"{weight.dtype}, grad {'on' if torch.is_grad_enabled() else 'off'})")
    return grouped_linear_torch(x, offsets, weight, bias)


def grouped_linear_torch(x: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path of `grouped_linear`: on CUDA in bf16 one `torch._grouped_mm` where this torch has it
    (`grouped_mm_linear`), else one GEMM per expert that has rows."""
    _check(x, offsets, weight, bias)
    if x.is_cuda and x.dtype == torch.bfloat16 and grouped_mm_applies(x, weight):
        return grouped_mm_linear(x, offsets, weight, bias)
    y = x.new_empty(x.shape[0], weight.shape[1])
    bounds = offsets.tolist()
    for e in range(weight.shape[0]):
        r0, r1 = bounds[e], bounds[e + 1]
        if r1 > r0:
            y[r0:r1] = F.linear(x[r0:r1], weight[e], None if bias is None else bias[e].to(x.dtype))
    return y


def grouped_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes these shapes (it exists in this torch; 16-byte aligned rows)."""
    return (hasattr(torch, "_grouped_mm") and x.shape[0] > 0 and x.dtype == weight.dtype == torch.bfloat16
            and x.shape[1] % 8 == 0 and weight.shape[1] % 8 == 0)


def grouped_mm_linear(x: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """All experts in one `torch._grouped_mm` (bf16; where `grouped_mm_applies`): no host read of the offsets."""
    y = torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets[1:].to(torch.int32))
    if bias is not None:
        expert = torch.searchsorted(offsets[1:], torch.arange(x.shape[0], device=x.device), right=True)
        y = y + bias.to(y.dtype)[expert]
    return y


def grouped_quant_linear_ref(x: torch.Tensor, offsets: torch.Tensor, w: QuantExperts,
                             bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of `grouped_quant_linear`, in float64: `grouped_linear_ref` over the exactly decoded experts."""
    weight = torch.stack([dequantize_ref(w.expert(e)) for e in range(w.shape[0])])
    return grouped_linear_ref(x, offsets, weight, bias)


def grouped_quant_linear(x: torch.Tensor, offsets: torch.Tensor, w: QuantExperts,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 or bf16 (rows sorted by expert), offsets [E + 1] int64 (expert e's rows at offsets[e] ..
    offsets[e + 1], offsets[E] = M), w: the experts [E, N, K] in a block format, bias [E, N] or None -> [M, N] in
    x's dtype (another float dtype runs in fp32). CPU only."""
    e, n, k = w.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"grouped_quant_linear: x [M, K = {k}] expected for {w.format_name} experts {w.shape}, got "
                         f"{tuple(x.shape)}")
    if offsets.shape != (e + 1,):
        raise ValueError(f"grouped_quant_linear: offsets [E + 1] = [{e + 1}] expected, got {tuple(offsets.shape)}")
    if bias is not None and bias.shape != (e, n):
        raise ValueError(f"grouped_quant_linear: bias [E, N] = {[e, n]} expected, got {tuple(bias.shape)}")
    if x.device.type != "cpu":
        raise ValueError(f"grouped_quant_linear runs on CPU only, got x on {x.device}")
    b = None if bias is None else bias.float().contiguous()
    if (ops := cpu.ops()) is not None:
        x2 = x.contiguous() if x.dtype == torch.bfloat16 else x.float().contiguous()
        return ops.grouped_quant_linear(x2, offsets.contiguous(), w.data, w.type_id, n, b).to(x.dtype)
    y = x.new_empty(x.shape[0], n)
    bounds = offsets.tolist()
    for j in range(e):
        r0, r1 = bounds[j], bounds[j + 1]
        if r1 > r0:
            y[r0:r1] = quant_linear(x[r0:r1], w.expert(j), None if b is None else b[j])
    return y
