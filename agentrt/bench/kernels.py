"""Kernel benchmark: how close paged attention gets to the GPU's memory bandwidth, and what paging costs.

Run as `agentrt bench kernels [--json] [--out docs/kernels.md]` (or `python -m agentrt.bench.kernels`); it
also writes the "Kernels" section of docs/benchmarks/kernels.md with `--docs`. Needs a CUDA GPU;
without one it says so, writes nothing and exits 0.

Measured in one run, on the Llama-3.1-8B attention shape (H=32, KVH=8, D=128, bf16, block 16):
- copy bandwidth: a device-to-device `torch` copy of a large buffer, (read + write bytes) / time;
- decode: achieved K/V read bandwidth of `paged_attention_triton` (split-K chosen automatically)
  for batch x context, as a fraction of the copy bandwidth;
- paging cost: the same decode with a shuffled block table, an identity table over contiguous
  blocks, and torch SDPA on a contiguous `[B, KVH, L, D]` cache;
- prefill: causal attention TFLOP/s, against torch SDPA (flash) on the same shapes;
- with `--sweep`, decode and prefill again under other tile shapes and split counts (the evidence for
  the launcher's choices).
Timing: `triton.testing.do_bench` (warm-up excluded, L2 flushed between calls, median).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

SKIP_MESSAGE = "no CUDA GPU: kernel benchmark skipped"
DOCS_SECTION = "Kernels"


@dataclass(frozen=True)
class Shape:
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16


BATCHES = [1, 8, 32, 64, 128, 256]
CONTEXTS = [512, 1024, 4096, 8192, 16384, 32768]
PAGING_BATCHES = [1, 8, 32, 128]
PAGING_CONTEXTS = [1024, 4096, 16384]
PREFILL_CASES = [(1024, 0), (4096, 0), (16384, 0), (512, 7680)]  # (new tokens, cached context)
MEMORY_FRACTION = 0.7  # of free GPU memory a case may allocate


def _time_ms(fn) -> float:
    import triton.testing

    fn()  # compile / autotune outside the measurement
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _copy_bandwidth(device: torch.device) -> dict:
    numel = 1 << 29  # 1 GiB of bf16
    src = torch.empty(numel, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    bytes_moved = 2 * src.numel() * src.element_size()
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": bytes_moved, "time_ms": ms, "gb_per_s": bytes_moved / ms / 1e6}


def _fits(num_bytes: int) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return num_bytes <= MEMORY_FRACTION * free


def _paged_cache(shape: Shape, num_blocks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    dims = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.empty(dims, dtype=shape.dtype, device=device).normal_()
    v_cache = torch.empty(dims, dtype=shape.dtype, device=device).normal_()
    return k_cache, v_cache


def _decode_meta(batch: int, context: int, table: torch.Tensor):
    from agentrt.kernels import build_attention_metadata

    device = table.device
    return build_attention_metadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_tables=table,
        max_query_len=1,
        max_seq_len=context,
    )


def _decode(shape: Shape, copy_gbps: float, device: torch.device, batches: list[int], contexts: list[int],
            paging_batches: list[int], paging_contexts: list[int]) -> tuple[list[dict], list[dict]]:
    import torch.nn.functional as F

    from agentrt.kernels import paged_attention_triton
    from agentrt.kernels.paged_attention import _auto_num_splits

    scale = shape.head_dim ** -0.5
    elem = torch.empty((), dtype=shape.dtype).element_size()
    decode, paging = [], []
    for context in contexts:
        for batch in batches:
            blocks_per_seq = -(-context // shape.block_size)
            num_blocks = batch * blocks_per_seq
            kv_bytes = 2 * batch * context * shape.num_kv_heads * shape.head_dim * elem
            cache_bytes = 2 * num_blocks * shape.block_size * shape.num_kv_heads * shape.head_dim * elem
            measure_paging = batch in paging_batches and context in paging_contexts
            needed = cache_bytes * (2 if measure_paging else 1)
            row = {"batch": batch, "context": context, "kv_bytes": kv_bytes}
            if not _fits(needed):
                decode.append({**row, "skipped": "does not fit in GPU memory"})
                continue
            k_cache, v_cache = _paged_cache(shape, num_blocks, device)
            shuffled = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_per_seq)
            meta = _decode_meta(batch, context, shuffled)
            q = torch.randn(batch, shape.num_heads, shape.head_dim, dtype=shape.dtype, device=device)
            ms = _time_ms(lambda: paged_attention_triton(q, k_cache, v_cache, meta, scale))
            gbps = kv_bytes / ms / 1e6
            decode.append({**row, "num_splits": _auto_num_splits(meta, shape.num_kv_heads, device), "time_ms": ms,
                           "gb_per_s": gbps, "fraction_of_copy": gbps / copy_gbps})
            if measure_paging:
                identity = torch.arange(num_blocks, dtype=torch.int32, device=device).view(batch, blocks_per_seq)
                meta_contiguous = _decode_meta(batch, context, identity)
                ms_contiguous = _time_ms(lambda: paged_attention_triton(q, k_cache, v_cache, meta_contiguous, scale))
                # The same keys as the identity table, as one contiguous [B, KVH, L, D] tensor per K and V.
                per_seq = (batch, -1, shape.num_kv_heads, shape.head_dim)
                k = k_cache.view(per_seq)[:, :context].transpose(1, 2).contiguous()
                v = v_cache.view(per_seq)[:, :context].transpose(1, 2).contiguous()
                q4 = q.unsqueeze(2)  # [B, H, 1, D]
                ms_sdpa = _time_ms(lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))
                paging.append({
                    "batch": batch, "context": context, "shuffled_ms": ms, "contiguous_ms": ms_contiguous,
                    "sdpa_contiguous_ms": ms_sdpa,
                    "paging_overhead_pct": 100 * (ms / ms_contiguous - 1),
                    "vs_sdpa_pct": 100 * (ms / ms_sdpa - 1),
                })
                del k, v
            del k_cache, v_cache, q, meta
            torch.cuda.empty_cache()
    return decode, paging


def _prefill_case(shape: Shape, device: torch.device, q_len: int, context: int):
    """One sequence of `q_len` new tokens after `context` cached ones over a shuffled block table:
    (q, k_cache, v_cache, meta, flops of its causal attention)."""
    from agentrt.kernels import build_attention_metadata

    seq_len = q_len + context
    blocks = -(-seq_len // shape.block_size)
    k_cache, v_cache = _paged_cache(shape, blocks, device)
    table = torch.randperm(blocks, device=device).to(torch.int32).view(1, blocks)
    meta = build_attention_metadata(
        torch.tensor([0, q_len], dtype=torch.int32, device=device),
        torch.tensor([seq_len], dtype=torch.int32, device=device), table, q_len, seq_len)
    q = torch.randn(q_len, shape.num_heads, shape.head_dim, dtype=shape.dtype, device=device)
    # Row i sees context + i + 1 keys; QK^T and PV cost 2 * D flops per (row, key, head) each.
    flops = 4 * (q_len * context + q_len * (q_len + 1) // 2) * shape.num_heads * shape.head_dim
    return q, k_cache, v_cache, meta, flops


def _prefill(shape: Shape, device: torch.device, cases: list[tuple[int, int]]) -> list[dict]:
    import torch.nn.functional as F

    from agentrt.kernels import paged_attention_triton

    scale = shape.head_dim ** -0.5
    rows = []
    for q_len, context in cases:
        q, k_cache, v_cache, meta, flops = _prefill_case(shape, device, q_len, context)
        ms = _time_ms(lambda: paged_attention_triton(q, k_cache, v_cache, meta, scale))
        row = {"q_len": q_len, "context": context, "time_ms": ms, "tflop_per_s": flops / ms / 1e9}
        if context == 0:  # SDPA's is_causal aligns the diagonal top-left, which is only right without context
            # K/V expanded to all query heads, so SDPA's flash kernel runs without GQA support.
            kv = torch.randn(2, 1, shape.num_heads, q_len, shape.head_dim, dtype=shape.dtype, device=device)
            q4 = q.transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
            ms_sdpa = _time_ms(lambda: F.scaled_dot_product_attention(q4, kv[0], kv[1], is_causal=True, scale=scale))
            row.update(sdpa_time_ms=ms_sdpa, sdpa_tflop_per_s=flops / ms_sdpa / 1e9, ratio_to_sdpa=ms_sdpa / ms)
            del kv
        rows.append(row)
        del k_cache, v_cache, q, meta
        torch.cuda.empty_cache()
    return rows


# Tile shapes tried by `--sweep`: (block_n, num_warps, num_stages) for decode (block_m stays 16),
# (block_m, block_n, num_warps, num_stages) for prefill. The first of each is the launcher's fixed shape
# before the first sweep; decode now takes block_n 128 when a launch has few programs per SM (from it).
DECODE_SWEEP = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (32, 4, 3), (32, 2, 4), (128, 4, 2), (128, 4, 3), (128, 8, 2),
                (128, 8, 3), (64, 8, 3)]
DECODE_SWEEP_CASES = [(32, 4096), (128, 4096), (32, 16384), (256, 8192)]
SPLIT_SWEEP = [2, 4, 8]
PREFILL_SWEEP = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2),
                 (64, 128, 4, 2), (128, 32, 4, 3)]
PREFILL_SWEEP_CASES = [(4096, 0), (512, 7680)]


def _sweep(shape: Shape, copy_gbps: float, device: torch.device) -> dict:
    """Time the decode and prefill kernels under each tile shape of the sweep lists (same data per case)."""
    from agentrt.kernels import paged_attention_triton
    from agentrt.kernels.paged_attention import launch_config

    scale = shape.head_dim ** -0.5
    elem = torch.empty((), dtype=shape.dtype).element_size()
    decode, prefill = [], []
    for batch, context in DECODE_SWEEP_CASES:
        blocks_per_seq = -(-context // shape.block_size)
        num_blocks = batch * blocks_per_seq
        kv_bytes = 2 * batch * context * shape.num_kv_heads * shape.head_dim * elem
        if not _fits(kv_bytes):
            continue
        k_cache, v_cache = _paged_cache(shape, num_blocks, device)
        table = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_per_seq)
        meta = _decode_meta(batch, context, table)
        q = torch.randn(batch, shape.num_heads, shape.head_dim, dtype=shape.dtype, device=device)
        variants = [({"block_n": bn, "num_warps": w, "num_stages": st}, None) for bn, w, st in DECODE_SWEEP]
        variants += [({}, splits) for splits in SPLIT_SWEEP]
        for config, splits in variants:
            try:
                with launch_config(**config):
                    ms = _time_ms(lambda: paged_attention_triton(q, k_cache, v_cache, meta, scale, num_splits=splits))
            except Exception as e:  # noqa: BLE001 - a tile shape that does not compile (e.g. out of shared memory)
                decode.append({"batch": batch, "context": context, **config, "splits": splits, "error": repr(e)[:200]})
                continue
            gbps = kv_bytes / ms / 1e6
            decode.append({"batch": batch, "context": context, **config, "splits": splits or "auto", "time_ms": ms,
                           "gb_per_s": gbps, "fraction_of_copy": gbps / copy_gbps})
        del k_cache, v_cache, q, meta
        torch.cuda.empty_cache()
    for q_len, context in PREFILL_SWEEP_CASES:
        q, k_cache, v_cache, meta, flops = _prefill_case(shape, device, q_len, context)
        for bm, bn, w, st in PREFILL_SWEEP:
            config = {"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st}
            try:
                with launch_config(**config):
                    ms = _time_ms(lambda: paged_attention_triton(q, k_cache, v_cache, meta, scale))
            except Exception as e:  # noqa: BLE001
                prefill.append({"q_len": q_len, "context": context, **config, "error": repr(e)[:200]})
                continue
            prefill.append({"q_len": q_len, "context": context, **config, "time_ms": ms,
                            "tflop_per_s": flops / ms / 1e9})
        del k_cache, v_cache, q, meta
        torch.cuda.empty_cache()
    return {"decode": decode, "prefill": prefill}


def _sweep_markdown(sweep: dict, heading: str) -> list[str]:
    lines = [f"{heading} Tile-shape sweep (decode: block_m 16)", "",
             "| batch | context | block_n | warps | stages | splits | time (µs) | % of copy BW |", "|" + "---|" * 8]
    for r in sweep["decode"]:
        cfg = [r.get("block_n", "-"), r.get("num_warps", "-"), r.get("num_stages", "-"), r.get("splits", "-")]
        res = ["error", r["error"][:60]] if "error" in r else [f"{r['time_ms'] * 1e3:.1f}",
                                                               f"{100 * r['fraction_of_copy']:.1f}"]
        lines.append("| " + " | ".join(str(c) for c in [r["batch"], r["context"], *cfg, *res]) + " |")
    lines += ["", f"{heading} Tile-shape sweep (prefill)", "",
              "| new tokens | context | block_m | block_n | warps | stages | time (ms) | TFLOP/s |", "|" + "---|" * 8]
    for r in sweep["prefill"]:
        cfg = [r["block_m"], r["block_n"], r["num_warps"], r["num_stages"]]
        res = ["error", r["error"][:60]] if "error" in r else [f"{r['time_ms']:.3f}", f"{r['tflop_per_s']:.1f}"]
        lines.append("| " + " | ".join(str(c) for c in [r["q_len"], r["context"], *cfg, *res]) + " |")
    return lines + [""]


def _markdown(result: dict, heading: str = "##") -> str:
    def table(header: list[str], rows: list[list[object]]) -> list[str]:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
        return out + [""]

    copy = result["copy"]
    lines = [f"{result['device']}; shape {result['shape']}; torch {result['torch']}, triton {result['triton']}.", "",
             f"Copy bandwidth (read + write): **{copy['gb_per_s']:.0f} GB/s**", "", f"{heading} Decode", ""]
    lines += table(["batch", "context", "splits", "time (µs)", "K/V GB/s", "% of copy BW"], [
        [r["batch"], r["context"], "-", "-", "-", r["skipped"]] if "skipped" in r else
        [r["batch"], r["context"], r["num_splits"], f"{r['time_ms'] * 1e3:.1f}", f"{r['gb_per_s']:.0f}",
         f"{100 * r['fraction_of_copy']:.1f}"]
        for r in result["decode"]])
    lines += [f"{heading} Paging cost (decode)", ""]
    lines += table(["batch", "context", "shuffled (µs)", "contiguous blocks (µs)", "SDPA contiguous (µs)",
                    "paging overhead %", "vs SDPA %"], [
        [r["batch"], r["context"], f"{r['shuffled_ms'] * 1e3:.1f}", f"{r['contiguous_ms'] * 1e3:.1f}",
         f"{r['sdpa_contiguous_ms'] * 1e3:.1f}", f"{r['paging_overhead_pct']:+.1f}", f"{r['vs_sdpa_pct']:+.1f}"]
        for r in result["paging"]])
    lines += [f"{heading} Prefill (one sequence, causal)", ""]
    lines += table(["new tokens", "context", "time (ms)", "TFLOP/s", "SDPA TFLOP/s", "SDPA time / ours"], [
        [r["q_len"], r["context"], f"{r['time_ms']:.3f}", f"{r['tflop_per_s']:.1f}",
         f"{r['sdpa_tflop_per_s']:.1f}" if "sdpa_tflop_per_s" in r else "-",
         f"{r['ratio_to_sdpa']:.2f}" if "ratio_to_sdpa" in r else "-"]
        for r in result["prefill"]])
    if "sweep" in result:
        lines += _sweep_markdown(result["sweep"], heading)
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentrt bench kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of the markdown tables")
    parser.add_argument("--out", type=Path, help="also write the result here (.json: JSON, else markdown)")
    parser.add_argument("--batches", type=_ints, default=BATCHES, help="decode batch sizes, comma-separated")
    parser.add_argument("--contexts", type=_ints, default=CONTEXTS, help="decode context lengths, comma-separated")
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill measurements")
    parser.add_argument("--sweep", action="store_true", help="also time other tile shapes and split counts")
    parser.add_argument("--docs", action=argparse.BooleanOptionalAction, default=False,
                        help=f"write the {DOCS_SECTION!r} section of docs/benchmarks/kernels.md (default: no)")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print(json.dumps({"skipped": SKIP_MESSAGE}) if args.json else SKIP_MESSAGE)
        return 0

    import triton

    torch.manual_seed(0)
    device = torch.device("cuda")
    shape = Shape()
    result: dict = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": f"H={shape.num_heads} KVH={shape.num_kv_heads} D={shape.head_dim} "
                 f"{str(shape.dtype).removeprefix('torch.')} block={shape.block_size}",
    }
    result["copy"] = _copy_bandwidth(device)
    result["decode"], result["paging"] = _decode(shape, result["copy"]["gb_per_s"], device, args.batches,
                                                 args.contexts, PAGING_BATCHES, PAGING_CONTEXTS)
    result["prefill"] = [] if args.no_prefill else _prefill(shape, device, PREFILL_CASES)
    if args.sweep:
        result["sweep"] = _sweep(shape, result["copy"]["gb_per_s"], device)

    markdown = f"# Kernel benchmark\n\n{_markdown(result)}\n"
    print(json.dumps(result, indent=2) if args.json else markdown)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) if args.out.suffix == ".json" else markdown)
    if args.docs:
        from agentrt.bench._common import write_section

        write_section(DOCS_SECTION, _markdown(result, heading="###"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
