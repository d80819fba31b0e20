"""Paging benchmark: what the block-table indirection, the block size and the step metadata cost (issue 51).

Run as `agentrt bench paging [--cases 16x1024,16x4096,64x1024] [--repeats 25] [--threads N] [--json] [--docs]` (or
`python -m agentrt.bench.paging`); `--docs` writes this CPU kind's section of docs/benchmarks/paging.md.
Measured in one process, on the CPU kernels (`kernels.paged_attention` on CPU tensors), SmolLM2-135M's
attention shape (9 query heads over 3 kv heads of 64, GQA 3):

1. Decode attention with a shuffled block table (a random permutation of the pool, what a long-running
   engine's free list hands out) against an identity table over contiguous blocks, fp32 and bf16, per
   batch x context (the seed's §3.2 question: what does the indirection cost in decode?). The two tables
   are timed call by call in turn, so a neighbour's load lands on both; reported: the best time of each
   and their ratio (a neighbour only ever adds time), and the median over the pairs of shuffled / contiguous.
   Twice where Linux offers transparent huge pages: the cache in torch's ordinary 4 KB pages, and in a mapping
   advised into 2 MB pages (`engine.huge_pages.empty`); the share the kernel actually gave in huge pages is reported.
2. Block-size sweep (16 ... 256 tokens): the same decode's time against block 16's; the prefix hit rate
   of the agent workload (agentrt.bench.workload's agent programs, each call's prompt and reply fed
   through the KV manager's block hashing, `prefix_hits`); and the KV bytes a stored token costs once
   each call's last block is rounded up to a whole block (`kv_bytes_per_token`).
   Superblocks (S = 1, 4, 16, 64 blocks of 16, `--kv-superblock-blocks`): the agent workload replayed through the KV
   manager on a bounded pool (`agentrt.bench.kv_replay`), under both rules for cached blocks in a run
   (engine.block_pool): prefix hit rate, KV bytes per stored token, the share of table entries physically after the
   entry before, and the decode kernel on the replay's block tables against contiguous and shuffled ones.
3. Host preparation of a decode step at 64 sequences x 32k context: the block tables and slot mapping
   as the runner built them before (per request: its block ids to numpy, the slots, a padded table) against
   `engine.block_table.BlockTables` (rows kept across steps, new ids only), and the whole `ModelRunner._prepare`
   of the engine now. Steps advance every sequence by one token; a sequence gains a block every 16 steps.
4. `bench tiers` t1 with in-place reads of host-tier blocks (engine.kv_tiers): measured by `agentrt bench tiers
   --configs t1-copy,t1` on the real engine (an agent workload, not a kernel); this page points to that table
   (`TIERS_IN_PLACE`) rather than copying a figure another benchmark owns.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable

import numpy as np
import torch

from agentrt.engine import huge_pages

DOCS_SECTION = "Paging (CPU {kind})"  # one section per kind of CPU kernels
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
KV_BYTES_PER_POSITION = 30 * 2 * NUM_KV_HEADS * HEAD_DIM * 2  # SmolLM2-135M: 30 layers, K and V, bf16
DTYPES = (torch.float32, torch.bfloat16)
BLOCK_SIZES = (16, 32, 64, 128, 256)
PREP_SEQS, PREP_CONTEXT, PREP_BLOCK = 64, 32768, 16
MIN_TIME_S = 0.2  # each timed kernel variant runs at least this long in all
# the agent workload of the hit-rate sweep: full-size agents (coding, ReAct: tens of thousands of tokens) and the
# CPU benchmarks' agent mix (short ReAct loops, 4-wide step programs)
AGENT_SETS = {"full-size agents (coding, ReAct)": ("agent", 8), "CPU agent mix (react_few, steps)": ("wait", 24)}
SUPERBLOCKS = (1, 4, 16, 64)  # superblock sizes of the sweep, in blocks
POOL_FRACTION = 0.5  # the superblock replay's pool: this share of the blocks the programs' last calls hold together


# ---- timing ---------------------------------------------------------------------------------------------
def interleaved(fns: list[Callable[[], object]], repeats: int, min_s: float | None = None) -> list[list[float]]:
    """Seconds of each call of each function, the functions called in turn (after one call each): `repeats` rounds,
    more while a function has run under `min_s` (default MIN_TIME_S) in all (short calls: enough of them for a best
    time), 5000 at most."""
    min_s = MIN_TIME_S if min_s is None else min_s
    for f in fns:
        f()
    times: list[list[float]] = [[] for _ in fns]
    rounds = 0
    while rounds < repeats or (rounds < 5000 and min(map(sum, times)) < min_s):
        for f, ts in zip(fns, times):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        rounds += 1
    return times


def pair_ratio(a: list[float], b: list[float]) -> float:
    """Median over interleaved pairs of a / b."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


# ---- 1 and 2: decode attention --------------------------------------------------------------------------
def _decode(batch: int, context: int, block_size: int, dtype: torch.dtype, seed: int = 0, huge: bool = False):
    """(q, k_cache, v_cache, contiguous metadata, shuffled metadata) of one decode step over `context` positions;
    the caches in 2 MB pages with `huge`."""
    from agentrt import kernels

    g = torch.Generator().manual_seed(seed)
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k, v = (torch.randn(*shape, generator=g).to(dtype) for _ in range(2))
    if huge:
        k, v = (huge_pages.empty(shape, dtype).copy_(x) for x in (k, v))
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=g).to(dtype)

    def meta(table: torch.Tensor):
        return kernels.build_attention_metadata(torch.arange(batch + 1, dtype=torch.int32),
                                                torch.full((batch,), context, dtype=torch.int32), table, 1, context)

    identity = torch.arange(num_blocks, dtype=torch.int32).view(batch, per_seq)
    shuffled = torch.randperm(num_blocks, generator=g).to(torch.int32).view(batch, per_seq)
    return q, k, v, meta(identity), meta(shuffled)


def decode_paging(cases: list[tuple[int, int]], repeats: int) -> list[dict]:
    """Shuffled vs contiguous tables per dtype and case, the cache in 4 KB pages (torch's allocation) and, where the
    kernel offers them, in 2 MB pages ("huge_granted": the share of the cache the kernel gave in huge pages)."""
    from agentrt import kernels

    rows = []
    for huge in (False, True) if huge_pages.supported() else (False,):
        for dtype in DTYPES:
            for batch, context in cases:
                before = huge_pages.anon_huge_bytes()
                q, k, v, contiguous, shuffled = _decode(batch, context, 16, dtype, huge=huge)
                granted = (huge_pages.anon_huge_bytes() - before) / (2 * k.numel() * k.element_size()) if huge else 0.0
                scale = HEAD_DIM ** -0.5
                ts, tc = interleaved([lambda: kernels.paged_attention(q, k, v, shuffled, scale),
                                      lambda: kernels.paged_attention(q, k, v, contiguous, scale)], repeats)
                fs, fc = memory_floor(k, v, shuffled, contiguous, repeats)
                rows.append({"pages": "2 MB" if huge else "4 KB", "huge_granted": min(1.0, max(0.0, granted)),
                             "dtype": str(dtype).removeprefix("torch."), "batch": batch, "context": context,
                             "shuffled_ms": min(ts) * 1e3, "contiguous_ms": min(tc) * 1e3,
                             "shuffled_over_contiguous": min(ts) / min(tc), "pair_median": pair_ratio(ts, tc),
                             "floor_shuffled_ms": min(fs) * 1e3, "floor_contiguous_ms": min(fc) * 1e3,
                             "floor_ratio": min(fs) / min(fc)})
                del q, k, v, contiguous, shuffled
    return rows


def memory_floor(k: torch.Tensor, v: torch.Tensor, shuffled, contiguous, repeats: int) -> tuple[list[float], list[float]]:
    """The memory system's own price of the order, no attention: the K and V blocks each table names copied out in
    the table's order (torch.index_select, parallel over blocks: a plain read of every block, a sequential write)
    and timed in turn, shuffled then contiguous. What this costs in the shuffled order over the contiguous one is
    the floor under any kernel's ratio on this machine."""
    ks, vs = k.view(k.shape[0], -1), v.view(v.shape[0], -1)
    out_k, out_v = torch.empty_like(ks), torch.empty_like(vs)

    def copy(meta):
        idx = meta.block_tables.reshape(-1).long()
        torch.index_select(ks, 0, idx, out=out_k[: idx.numel()])
        torch.index_select(vs, 0, idx, out=out_v[: idx.numel()])

    ts, tc = interleaved([lambda: copy(shuffled), lambda: copy(contiguous)], repeats)
    return ts, tc


def block_size_kernel(case: tuple[int, int], sizes: Iterable[int], repeats: int) -> list[dict]:
    """Shuffled-table decode of `case` at each block size, the sizes timed in turn; ratios to the first size."""
    from agentrt import kernels

    batch, context = case
    rows = []
    for dtype in DTYPES:
        inputs = {bs: _decode(batch, context, bs, dtype) for bs in sizes}
        scale = HEAD_DIM ** -0.5
        fns = [lambda x=x: kernels.paged_attention(x[0], x[1], x[2], x[4], scale) for x in inputs.values()]
        times = interleaved(fns, repeats)
        for bs, ts in zip(inputs, times):
            rows.append({"dtype": str(dtype).removeprefix("torch."), "block_size": bs,
                         "ms": min(ts) * 1e3, "vs_first": min(ts) / min(times[0])})
        del inputs
    return rows


# ---- 2: prefix hits and bytes per token on the agent workload ----------------------------------------------
def program_calls(spec, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """The (prompt, reply) token ids of each call of a workload program (`agentrt.bench.workload.ProgramSpec`), in
    order (a step's parallel calls one after another); replies are fresh random ids of the call's max_tokens."""
    from agentrt.bench import workload

    rng = random.Random(spec.seed ^ seed ^ 0x5EED)
    gen, value, calls = workload.plan(spec), None, []
    while True:
        try:
            action = gen.send(value)
        except StopIteration:
            return calls
        if isinstance(action, workload.Call):
            value = workload.tokens(rng, action.max_tokens)
            calls.append((action.prompt, value))
        elif isinstance(action, workload.Parallel):
            value = [workload.tokens(rng, c.max_tokens) for c in action.calls]
            calls.extend((c.prompt, out) for c, out in zip(action.calls, value))
        else:
            value = action.observation


def prefix_hits(calls: Iterable[tuple[list[int], list[int]]], block_size: int, extra: bytes = b"") -> tuple[int, int]:
    """(prompt tokens served from the prefix cache, prompt tokens) of `calls` run one after another on one engine
    whose cache keeps every block, hashed as the KV manager hashes (`hash_block`, chained from `extra`): a call hits
    the longest run of its prompt's full blocks that earlier calls computed, its last prompt token always left to
    compute; it computes its prompt and reply but the reply's last token and leaves their full blocks cached."""
    from agentrt.engine.kv_cache_manager import hash_block

    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    cached: set[bytes] = set()
    memo: dict[tuple[bytes | None, tuple[int, ...]], bytes] = {}  # the chain of a shared prefix is hashed once
    hit = total = 0
    for prompt, reply in calls:
        seq = [*prompt, *reply]
        hashes, parent = [], None
        for i in range((len(seq) - 1) // block_size):
            key = (parent, tuple(seq[i * block_size : (i + 1) * block_size]))
            h = memo.get(key)
            if h is None:
                h = memo[key] = hash_block(parent, list(key[1]), extra)
            hashes.append(h)
            parent = h
        n = 0
        while n < (len(prompt) - 1) // block_size and hashes[n] in cached:
            n += 1
        hit += n * block_size
        total += len(prompt)
        cached.update(hashes)
    return hit, total


def kv_bytes_per_token(lengths: Iterable[int], block_size: int, bytes_per_position: int = KV_BYTES_PER_POSITION) -> float:
    """KV bytes a stored token costs when each sequence of `lengths` tokens holds whole blocks of `block_size`."""
    lengths = list(lengths)
    if not lengths or min(lengths) < 1:
        raise ValueError(f"need sequences of at least one token, got {lengths[:5]!r}...")
    held = sum(-(-n // block_size) * block_size for n in lengths)
    return held * bytes_per_position / sum(lengths)


def agent_workloads(seed: int) -> dict[str, list[list[tuple[list[int], list[int]]]]]:
    """Per agent set (AGENT_SETS), each program's calls."""
    from agentrt.bench import workload

    out = {}
    for name, (kind, n) in AGENT_SETS.items():
        mix = workload.AGENT_MIX if kind == "agent" else workload.AGENT_WAIT_MIX
        out[name] = [program_calls(s, seed) for s in workload.make_agent_workload(n, 1.0, seed, mix)]
    return out


def block_size_workload(sizes: Iterable[int], seed: int) -> list[dict]:
    rows = []
    for name, programs in agent_workloads(seed).items():
        calls = [c for p in programs for c in p]
        lengths = [len(p) + len(r) for p, r in calls]
        for bs in sizes:
            hit, total = prefix_hits(calls, bs)
            per_token = kv_bytes_per_token(lengths, bs)
            rows.append({"workload": name, "block_size": bs, "programs": len(programs), "calls": len(calls),
                         "prompt_tokens": total, "hit_rate": hit / total, "kv_bytes_per_token": per_token,
                         "waste": per_token / KV_BYTES_PER_POSITION - 1})
    return rows


# ---- 2: superblocks on the agent workload ------------------------------------------------------------------
def superblock_kernel(tables: list[list[int]], num_blocks: int, block_size: int, repeats: int, seed: int = 0
                      ) -> list[dict]:
    """Decode attention over `tables` (a replay's block tables, each read whole) against the same sequence lengths
    with every sequence's blocks contiguous and with blocks drawn at random from the pool, per dtype: best ms of
    each, the three called in turn."""
    from agentrt import kernels

    lens = [len(t) for t in tables]
    if not lens or min(lens) < 1:
        raise ValueError(f"need block tables of at least one block, got lengths {lens[:5]!r}")
    batch, width, total = len(lens), max(lens), sum(lens)
    pool = max(num_blocks, total)  # a table may name a shared block twice; the others never do
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(pool, generator=g).tolist()
    starts = np.cumsum([0, *lens]).tolist()
    layouts = {"replay": tables, "contiguous": [list(range(starts[i], starts[i + 1])) for i in range(batch)],
               "shuffled": [perm[starts[i] : starts[i + 1]] for i in range(batch)]}
    rows = []
    for dtype in DTYPES:
        shape = (pool, block_size, NUM_KV_HEADS, HEAD_DIM)
        k, v = (torch.randn(*shape, generator=g).to(dtype) for _ in range(2))
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=g).to(dtype)
        metas = {}
        for name, rows_of in layouts.items():
            table = torch.zeros(batch, width, dtype=torch.int32)
            for i, t in enumerate(rows_of):
                table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
            metas[name] = kernels.build_attention_metadata(
                torch.arange(batch + 1, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32) * block_size,
                table, 1, width * block_size)
        scale = HEAD_DIM ** -0.5
        times = interleaved([lambda m=m: kernels.paged_attention(q, k, v, m, scale) for m in metas.values()], repeats)
        best = {name: min(ts) * 1e3 for name, ts in zip(metas, times)}
        rows.append({"dtype": str(dtype).removeprefix("torch."), **{f"{n}_ms": ms for n, ms in best.items()},
                     "replay_over_contiguous": best["replay"] / best["contiguous"],
                     "shuffled_over_contiguous": best["shuffled"] / best["contiguous"]})
        del k, v, q, metas
    return rows


def superblock_sweep(superblocks: Iterable[int], seed: int, repeats: int, fraction: float = POOL_FRACTION,
                     block_size: int = 16, kernel: bool = True) -> list[dict]:
    """Per agent set, per superblock size and rule for cached blocks (engine.block_pool: LRU-bounded, the engine's;
    and evicting early): the workload replayed through the KV manager on a pool of `fraction` of its working set
    (agentrt.bench.kv_replay), and the decode kernel on the block tables the replay held when its pool was fullest."""
    from agentrt.bench import kv_replay

    superblocks, rows = list(superblocks), []
    if not superblocks:
        return rows
    for name, programs in agent_workloads(seed).items():
        num_blocks = kv_replay.pool_blocks(programs, block_size, fraction)
        for early in (False, True):
            for s in superblocks:
                if early and s == 1:
                    continue  # S = 1 takes nothing out of LRU order: one rule
                st = kv_replay.replay(programs, num_blocks, block_size, s, early)
                rows.append({
                    "workload": name, "superblock_blocks": s, "evict_early": early, "num_blocks": num_blocks,
                    "pool_fraction": fraction, "calls": st.calls, "prompt_tokens": st.prompt_tokens,
                    "hit_rate": st.hit_rate, "preemptions": st.preemptions, "evictions": st.evictions,
                    "kv_bytes_per_token": st.kv_bytes_per_token(KV_BYTES_PER_POSITION),
                    "contiguous": st.contiguous_fraction, "blocks_per_run": st.mean_run_blocks,
                    "snapshot_seqs": len(st.snapshot), "snapshot_blocks": sum(map(len, st.snapshot)),
                    "kernel": superblock_kernel(st.snapshot, num_blocks, block_size, repeats) if kernel else [],
                })
    return rows


# ---- 3: host preparation of a step ------------------------------------------------------------------------
def old_tables_and_slots(reqs, num_tokens: list[int], block_size: int):
    """The runner's table / slot code before engine.block_table (per request: its block ids to numpy, the
    slots of its new positions; then a padded table): (positions, slot mapping, block table) as torch tensors."""
    bs = block_size
    positions, slots, tables = [], [], []
    for req, n in zip(reqs, num_tokens):
        start = req.num_computed_tokens
        pos = np.arange(start, start + n)
        positions.append(pos)
        table = np.asarray(req.block_ids, dtype=np.int64)
        slots.append(table[pos // bs] * bs + pos % bs)
        tables.append(table)
    max_blocks = max(len(t) for t in tables)
    block_tables = np.zeros((len(tables), max_blocks), dtype=np.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = t
    return (torch.from_numpy(np.concatenate(positions)), torch.from_numpy(np.concatenate(slots)),
            torch.from_numpy(block_tables))


def new_tables_and_slots(block_tables, reqs, num_tokens: list[int]):
    """The same through `BlockTables.prepare` (group 0)."""
    st = block_tables.prepare(reqs, [r.num_computed_tokens for r in reqs], num_tokens)
    return (torch.from_numpy(st.positions), torch.from_numpy(st.slot_mappings[0]),
            torch.from_numpy(st.block_tables[0]))


class _StubModel:
    """What ModelRunner needs of a model to build a step's inputs (no forward is run)."""

    batch_invariant = False

    def __init__(self):
        from types import SimpleNamespace

        self.args = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=1)

    def set_kv_layout(self, layout) -> None:
        pass


def decode_requests(num_seqs: int, context: int, block_size: int, seed: int = 0):
    """`num_seqs` running requests `context` tokens long, each about to decode its next token, their blocks a
    shuffled pool with a spare block each (the requests end at different offsets within their last block)."""
    from agentrt.engine.request import Request, RequestStatus
    from agentrt.engine.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    per_seq = -(-(context + block_size) // block_size)
    pool = rng.permutation(num_seqs * per_seq).tolist()
    reqs = []
    for i in range(num_seqs):
        n = context - i % block_size
        r = Request(f"r{i}", [7] * n, SamplingParams(max_tokens=1 << 20, ignore_eos=True))
        r.num_computed_tokens = n - 1
        r.block_ids = pool[i * per_seq : i * per_seq + -(-n // block_size)]
        r.status = RequestStatus.RUNNING
        reqs.append((r, pool[i * per_seq + len(r.block_ids) : (i + 1) * per_seq]))
    return reqs


def _advance(reqs, block_size: int) -> None:
    """One decode step's bookkeeping: each sequence's token computed and a new one appended; a block added where
    the next token needs one (what the scheduler's allocate_slots does)."""
    for r, spare in reqs:
        r.num_computed_tokens += 1
        r.all_token_ids.append(7)
        if r.num_computed_tokens // block_size >= len(r.block_ids):
            r.block_ids.append(spare.pop() if spare else 0)


def host_prep(num_seqs: int, context: int, block_size: int, steps: int) -> dict:
    from agentrt.engine.block_table import BlockTables
    from agentrt.engine.runner import ModelRunner
    from agentrt.engine.scheduler import SchedulerOutput

    ones = [1] * num_seqs
    steps_of, states = {}, {}
    for name in ("old", "new", "prepare"):  # each on its own requests
        reqs = decode_requests(num_seqs, context, block_size)
        batch = [r for r, _ in reqs]
        if name == "old":
            step = functools.partial(old_tables_and_slots, batch, ones, block_size)
        elif name == "new":
            step = functools.partial(new_tables_and_slots, BlockTables(block_size), batch, ones)
        else:
            runner = ModelRunner(_StubModel(), 1, block_size, torch.float32, "cpu")
            step = functools.partial(runner._prepare, SchedulerOutput(batch, ones, []))
        step()  # the first step writes every row: not the steady state
        _advance(reqs, block_size)
        steps_of[name], states[name] = step, reqs
    times: dict[str, list[float]] = {name: [] for name in steps_of}
    for i in range(steps):  # the three called in turn, so a neighbour's load lands on all; the old one every 10th step
        for name, step in steps_of.items():
            if name == "old" and i % 10:
                continue
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
            _advance(states[name], block_size)
    result = {"seqs": num_seqs, "context": context, "block_size": block_size, "steps": steps}
    for name, ts in times.items():
        ts.sort()
        result[f"{name}_us"] = statistics.median(ts) * 1e6
        result[f"{name}_p10_us"] = ts[len(ts) // 10] * 1e6
    result["old_over_new"] = result["old_us"] / result["new_us"]
    return result


def check_equal(num_seqs: int = 8, context: int = 300, block_size: int = 16, steps: int = 40) -> None:
    """The new tables and slots equal the old code's on the benchmark's own steps (raises if not)."""
    from agentrt.engine.block_table import BlockTables

    reqs = decode_requests(num_seqs, context, block_size, seed=1)
    batch, bt = [r for r, _ in reqs], BlockTables(block_size)
    for _ in range(steps):
        old = old_tables_and_slots(batch, [1] * num_seqs, block_size)
        new = new_tables_and_slots(bt, batch, [1] * num_seqs)
        width = old[2].shape[1]
        if not (torch.equal(old[0], new[0]) and torch.equal(old[1], new[1]) and torch.equal(old[2], new[2][:, :width])
                and not new[2][:, width:].any()):
            raise AssertionError("BlockTables and the old per-request tables disagree")
        _advance(reqs, block_size)


TIERS_IN_PLACE = {"command": "agentrt bench tiers --configs t1-copy,t1 --write-docs",
                  "page": "tiers.md#kv-tiers-bench-tiers-real-engine"}


# ---- the run ----------------------------------------------------------------------------------------------
def measure(cases: list[tuple[int, int]], sizes: list[int], sweep_case: tuple[int, int], repeats: int,
            prep_steps: int, seed: int, superblocks: Iterable[int] = SUPERBLOCKS, pool_fraction: float = POOL_FRACTION
            ) -> dict:
    from agentrt.kernels import cpu

    check_equal()
    return {
        "kernels": cpu.describe(), "threads": torch.get_num_threads(), "repeats": repeats,
        "decode": decode_paging(cases, repeats),
        "block_size_kernel": block_size_kernel(sweep_case, sizes, repeats), "sweep_case": list(sweep_case),
        "block_size_workload": block_size_workload(sizes, seed),
        "superblocks": superblock_sweep(superblocks, seed, repeats, pool_fraction),
        "host_prep": host_prep(PREP_SEQS, PREP_CONTEXT, PREP_BLOCK, prep_steps),
        "tiers_in_place": dict(TIERS_IN_PLACE),  # measured by bench tiers (module docstring, 4)
    }


def markdown(result: dict) -> str:
    from agentrt.bench._common import markdown_table

    d = result["decode"]
    worst = {pages: max(abs(r["shuffled_over_contiguous"] - 1) for r in d if r["pages"] == pages)
             for pages in dict.fromkeys(r["pages"] for r in d)}
    lines = [
        f"Kernels: {result['kernels']}; {result['threads']} threads; SmolLM2-135M attention ({NUM_HEADS} query / "
        f"{NUM_KV_HEADS} kv heads x {HEAD_DIM}); kernel times are the best of {result['repeats']} calls, the "
        "compared variants called in turn.",
        "",
        "### Decode attention: shuffled vs contiguous block table (block 16)",
        "",
        markdown_table(["cache pages", "dtype", "batch", "context", "shuffled ms", "contiguous ms",
                        "shuffled / contiguous", "median of pairs", "memory floor: copy shuffled / contiguous"],
                       [[r["pages"] + (f" ({100 * r['huge_granted']:.0f}% granted)" if r["pages"] != "4 KB" else ""),
                         r["dtype"], r["batch"], r["context"], f"{r['shuffled_ms']:.2f}", f"{r['contiguous_ms']:.2f}",
                         f"**{r['shuffled_over_contiguous']:.3f}**", f"{r['pair_median']:.3f}",
                         f"{r['floor_ratio']:.3f} ({r['floor_shuffled_ms']:.2f} / {r['floor_contiguous_ms']:.2f} ms)"]
                        for r in d]),
        "",
        "Largest gap (target <= 5%): " + "; ".join(f"cache in {pages} pages **{100 * w:.1f}%**"
                                                  for pages, w in worst.items()) + ". A shuffled table walks the cache "
        "block by block in random order: with 4 KB pages a block of 16 positions spans a few pages, each jump a TLB "
        "miss a contiguous walk mostly avoids; 2 MB pages (transparent huge pages, MADV_HUGEPAGE) take that away. The "
        "last column is the machine's own price of the order: the same K and V blocks copied out in each table's order "
        "(no attention, `memory_floor`); where a kernel's ratio is near it, the kernel adds nothing of its own to the "
        f"order's cost (largest floor: {max(r['floor_ratio'] for r in d):.3f}; rows over their floor by more than 0.05: "
        f"{sum(r['pair_median'] > r['floor_ratio'] + 0.05 for r in d)} of {len(d)}). "
        "The fp32 walk reads a block 4 positions at a time and prefetches the same rows of the next block meanwhile, "
        "and the heads of the 4 KB pages of the block two ahead (kernels/csrc/attention.h says why), the bf16 walk the "
        "rows of the next 32 positions; the engine's KV tensor stays in 4 KB pages (engine.huge_pages says why: a "
        "2 MB page's first touch costs the step that makes it).",
        "",
        f"### Block size: decode time ({result['sweep_case'][0]} x {result['sweep_case'][1]}, shuffled table)",
        "",
    ]
    k = result["block_size_kernel"]
    dtypes = list(dict.fromkeys(r["dtype"] for r in k))
    sizes = list(dict.fromkeys(r["block_size"] for r in k))
    by = {(r["dtype"], r["block_size"]): r for r in k}
    lines += [markdown_table(["block size", *(f"{dt} ms" for dt in dtypes), *(f"{dt} / block {sizes[0]}" for dt in dtypes)],
                             [[bs, *(f"{by[dt, bs]['ms']:.2f}" for dt in dtypes),
                               *(f"{by[dt, bs]['vs_first']:.3f}" for dt in dtypes)] for bs in sizes]), ""]
    w = result["block_size_workload"]
    lines += ["### Block size: prefix hits and KV bytes on the agent workload", ""]
    for name in dict.fromkeys(r["workload"] for r in w):
        rows = [r for r in w if r["workload"] == name]
        lines += [f"{name}: {rows[0]['programs']} programs, {rows[0]['calls']} calls, {rows[0]['prompt_tokens']:,} "
                  "prompt tokens; every block kept (no eviction), hashed as the KV manager hashes.", "",
                  markdown_table(["block size", "prefix hit rate", "KV bytes / stored token (bf16)", "last-block waste"],
                                 [[r["block_size"], f"{100 * r['hit_rate']:.1f}%", f"{r['kv_bytes_per_token']:,.0f}",
                                   f"{100 * r['waste']:.1f}%"] for r in rows]), ""]
    lines += superblock_markdown(result.get("superblocks") or [])
    h = result["host_prep"]
    lines += [
        f"### Host preparation of a decode step ({h['seqs']} sequences x {h['context'] // 1024}k context, "
        f"block {h['block_size']})", "",
        markdown_table(["what", "us a step (median)", "p10"], [
            ["block tables + slot mapping, old (per request: ids to numpy, padded table)", f"{h['old_us']:,.0f}",
             f"{h['old_p10_us']:,.0f}"],
            ["block tables + slot mapping, BlockTables (rows kept, new ids only)", f"**{h['new_us']:,.1f}**",
             f"{h['new_p10_us']:,.1f}"],
            ["whole ModelRunner._prepare now (token ids, lengths, metadata too)", f"{h['prepare_us']:,.0f}",
             f"{h['prepare_p10_us']:,.0f}"],
        ]), "",
        f"Old / new: **{h['old_over_new']:.0f}x** (target: new <= 50 us).", "",
        "### `bench tiers` t1 with in-place reads", "",
        f"Measured by `{TIERS_IN_PLACE['command']}` ([its second table]({TIERS_IN_PLACE['page']})): the calls that "
        "loaded from T1, their time to first token, the tokens loaded, the share read in place and the T0 blocks "
        "the loads took, with T1 hits read where they lie (t1) and copied into the pool first (t1-copy).",
    ]
    return "\n".join(lines) + "\n"


def superblock_markdown(rows: list[dict]) -> list[str]:
    """The superblock sweep's tables, one per agent set (nothing without rows)."""
    from agentrt.bench._common import markdown_table

    if not rows:
        return []
    lines = ["### Superblocks: prefix hits, KV bytes, contiguity and decode time on the agent workload (block 16)", "",
             "Each agent set replayed through the KV manager on a bounded pool (agentrt.bench.kv_replay: every program "
             "at once, its calls in order, 512-token prefill chunks, recompute preemption), per superblock size S "
             "(`--kv-superblock-blocks`) and rule for cached blocks in a run: *LRU-bounded* (the engine's: a block "
             "leaves LRU order only if it has no hash or LRU would evict it for the same allocation) or *early* (any "
             "free run, cached blocks evicted before their LRU turn). Contiguous: table entries whose block follows "
             "the entry before's physically. Decode: the block tables the replay held when its pool was fullest, "
             "against the same lengths on contiguous and on randomly drawn blocks.", ""]
    for name in dict.fromkeys(r["workload"] for r in rows):
        rs = [r for r in rows if r["workload"] == name]
        dtypes = list(dict.fromkeys(k["dtype"] for r in rs for k in r["kernel"]))
        r0 = rs[0]
        lines += [f"{name}: {r0['calls']} calls, {r0['prompt_tokens']:,} prompt tokens, a pool of {r0['num_blocks']:,} "
                  f"blocks ({100 * r0['pool_fraction']:.0f}% of what the programs' last calls hold together); decode "
                  f"on {r0['snapshot_seqs']} tables of {r0['snapshot_blocks']:,} blocks (S = {r0['superblock_blocks']}).", ""]
        head = ["S", "rule", "prefix hit rate", "evictions", "preemptions", "KV bytes / stored token (bf16)",
                "contiguous", "blocks / run"]
        for dt in dtypes:
            head += [f"{dt} replay ms", f"{dt} replay / contiguous", f"{dt} shuffled / contiguous"]
        body = []
        for r in rs:
            k = {x["dtype"]: x for x in r["kernel"]}
            row = [r["superblock_blocks"], "early" if r["evict_early"] else "LRU-bounded", f"{100 * r['hit_rate']:.1f}%",
                   f"{r['evictions']:,}", r["preemptions"], f"{r['kv_bytes_per_token']:,.0f}",
                   f"{100 * r['contiguous']:.1f}%", f"{r['blocks_per_run']:.1f}"]
            for dt in dtypes:
                row += [f"{k[dt]['replay_ms']:.2f}", f"**{k[dt]['replay_over_contiguous']:.3f}**",
                        f"{k[dt]['shuffled_over_contiguous']:.3f}"] if dt in k else ["", "", ""]
            body.append(row)
        lines += [markdown_table(head, body), ""]
    return lines


def _cases(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        b, _, c = part.strip().partition("x")
        if not (b.isdigit() and c.isdigit()) or int(b) < 1 or int(c) < 1:
            raise ValueError(f"a case is BATCHxCONTEXT with positive integers, got {part.strip()!r}")
        out.append((int(b), int(c)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt bench paging", description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="16x1024,16x4096,64x1024", help="decode cases BATCHxCONTEXT, comma-separated")
    ap.add_argument("--sweep-case", default="16x4096", help="the decode case of the block-size sweep")
    ap.add_argument("--block-sizes", default=",".join(map(str, BLOCK_SIZES)), help="block sizes of the sweep")
    ap.add_argument("--superblocks", default=",".join(map(str, SUPERBLOCKS)),
                    help="superblock sizes of the sweep, in blocks (powers of two; empty: no sweep)")
    ap.add_argument("--pool-fraction", type=float, default=POOL_FRACTION,
                    help="the superblock replay's pool, as a share of the blocks the programs' last calls hold")
    ap.add_argument("--repeats", type=int, default=25, help="timed calls per variant")
    ap.add_argument("--prep-steps", type=int, default=300, help="decode steps timed for the host preparation")
    ap.add_argument("--seed", type=int, default=0, help="seed of the agent workload")
    ap.add_argument("--threads", type=int, default=None, help="torch / kernel threads (default: torch's)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the markdown tables")
    ap.add_argument("--docs", action=argparse.BooleanOptionalAction, default=False,
                    help="write this CPU kind's section of docs/benchmarks/paging.md (default: no)")
    a = ap.parse_args(argv)
    try:
        cases, (sweep,) = _cases(a.cases), _cases(a.sweep_case)
    except ValueError as e:
        ap.error(str(e))
    try:
        sizes = [int(s) for s in a.block_sizes.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--block-sizes must be comma-separated integers, got {a.block_sizes!r}")
    if not sizes or min(sizes) < 1:
        ap.error(f"--block-sizes must be positive, got {a.block_sizes!r}")
    try:
        superblocks = [int(s) for s in a.superblocks.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--superblocks must be comma-separated integers, got {a.superblocks!r}")
    if any(s < 1 or s & (s - 1) for s in superblocks):
        ap.error(f"--superblocks must be powers of two >= 1, got {a.superblocks!r}")
    if not 0 < a.pool_fraction <= 4:
        ap.error(f"--pool-fraction must be in (0, 4], got {a.pool_fraction}")
    if a.repeats < 1 or a.prep_steps < 1:
        ap.error(f"--repeats and --prep-steps must be >= 1, got {a.repeats} and {a.prep_steps}")
    if a.threads is not None:
        if a.threads < 1:
            ap.error(f"--threads must be >= 1, got {a.threads}")
        torch.set_num_threads(a.threads)
    result = measure(cases, sizes, sweep, a.repeats, a.prep_steps, a.seed, superblocks, a.pool_fraction)
    text = markdown(result)
    print(json.dumps(result, indent=2) if a.json else text)
    if a.docs:
        from agentrt.bench._common import write_section
        from agentrt.kernels import cpu

        write_section(DOCS_SECTION.format(kind=cpu.kind()), text, name="paging")
    return 0


if __name__ == "__main__":
    sys.exit(main())
