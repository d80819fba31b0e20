"""An agent workload's calls replayed through the engine's KV manager (`engine.kv_cache_manager`) on a bounded pool,
without a model: what the pool's allocation order (superblocks, engine.block_pool) does to prefix hits, the KV a
stored token costs and how contiguous the block tables are (`bench paging`'s superblock sweep).

The replay is the scheduler's KV bookkeeping: every program runs its calls in order (a call arrives when the
program's previous one ends; no tool time), all programs at once. Each step, waiting calls are admitted in arrival
order while their prefix hit and first chunk fit (`get_computed_blocks`, `allocate_slots`), after the running
calls, oldest first, got their next prompt chunk (up to `chunk_tokens`) or decode token; where one does not fit,
the newest running call is preempted (freed, readmitted first with the tokens it had, recomputed past what the
cache still holds: the engine's recompute preemption) and no call is admitted that step. Every scheduled call then
computes and registers its full blocks (`cache_blocks`). A call's reply is the workload's: each token is appended
once the tokens before it are computed, the last one never computed (as `agentrt.bench.paging.prefix_hits`
counts).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from agentrt.engine.kv_cache_manager import KVCacheManager
from agentrt.engine.request import Request
from agentrt.engine.sampling_params import SamplingParams

CHUNK_TOKENS = 512  # prompt tokens a call computes per step at most (chunked prefill)
SNAPSHOT_GROWTH = 1.02  # the block tables are copied again when the pool holds this much more than at the last copy

Calls = Sequence[tuple[list[int], list[int]]]  # one program's (prompt, reply) token ids, in order


@dataclass(slots=True)
class ReplayStats:
    superblock_blocks: int  # the pool's S (1: LRU order only)
    runs_evict_early: bool  # the pool's rule for cached blocks inside runs (engine.block_pool)
    num_blocks: int  # the pool's size
    block_size: int  # tokens per block
    calls: int = 0  # calls finished
    prompt_tokens: int = 0  # their prompts' tokens
    hit_tokens: int = 0  # of those, served from the cache at each call's first admission
    preemptions: int = 0  # running calls preempted for want of a block
    evictions: int = 0  # cached blocks reused (their hash dropped)
    run_blocks: int = 0  # blocks handed out contiguously, not in LRU order
    steps: int = 0
    held_blocks: int = 0  # Σ over steps of the pool's blocks in use (a shared block once)
    stored_tokens: int = 0  # Σ over steps of the tokens the running calls store (computed or computed this step)
    table_entries: int = 0  # Σ over finished calls' block tables of the entries after the first
    adjacent_entries: int = 0  # of those, the entries whose block is the one after the previous entry's
    table_runs: int = 0  # Σ over finished calls of the physically contiguous runs their tables make
    snapshot: list[list[int]] = field(default_factory=list)  # the running calls' tables when the pool held most

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def contiguous_fraction(self) -> float:
        """The share of table entries (after each table's first) that physically follow the entry before."""
        return self.adjacent_entries / self.table_entries if self.table_entries else 0.0

    @property
    def mean_run_blocks(self) -> float:
        """Blocks per physically contiguous run of a finished call's table."""
        return (self.table_entries + self.calls) / self.table_runs if self.table_runs else 0.0

    def kv_bytes_per_token(self, bytes_per_position: int) -> float:
        """KV bytes the pool holds per token the running calls store (whole blocks, shared ones once)."""
        return self.held_blocks * self.block_size * bytes_per_position / max(1, self.stored_tokens)


@dataclass(slots=True)
class _Call:
    prompt: list[int]
    reply: list[int]
    program: int
    req: Request | None = None  # while admitted or waiting to be readmitted
    admitted: bool = False  # admitted once (its hits counted)
    appended: int = 0  # reply tokens it had when last preempted (kept, as the engine keeps a preempted call's output)
    scheduled: int = 0  # tokens it computes this step


def pool_blocks(programs: Sequence[Calls], block_size: int, fraction: float) -> int:
    """A pool of `fraction` of the blocks every program's longest call holds together (its whole context at the
    end), never below what the longest call needs alone (plus one block)."""
    if not 0 < fraction:
        raise ValueError(f"fraction must be > 0, got {fraction!r}")
    lengths = [max(len(p) + len(r) for p, r in calls) for calls in programs if calls]
    if not lengths:
        raise ValueError("the workload has no calls")
    need = [-(-n // block_size) for n in lengths]
    return max(round(fraction * sum(need)), max(need) + 1)


def replay(programs: Sequence[Calls], num_blocks: int, block_size: int = 16, superblock_blocks: int = 1,
           runs_evict_early: bool = False, chunk_tokens: int = CHUNK_TOKENS) -> ReplayStats:
    """Replay `programs` (module docstring) on a pool of `num_blocks` blocks; every block is free again at the end
    (checked)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens!r}")
    kv = KVCacheManager(num_blocks, block_size, superblock_blocks=superblock_blocks, runs_evict_early=runs_evict_early)
    for calls in programs:
        for prompt, reply in calls:
            if not prompt:
                raise ValueError("a call has an empty prompt")
            if kv.blocks_for(len(prompt) + len(reply)) > num_blocks:
                raise ValueError(f"a call of {len(prompt)} + {len(reply)} tokens needs "
                                 f"{kv.blocks_for(len(prompt) + len(reply))} blocks; the pool has {num_blocks}")
    st = ReplayStats(superblock_blocks, runs_evict_early, num_blocks, block_size)
    todo = [deque(_Call(p, r, i) for p, r in calls) for i, calls in enumerate(programs)]
    waiting: deque[_Call] = deque(q.popleft() for q in todo if q)
    running: list[_Call] = []
    ids = itertools.count()
    snapshot_at = 0
    while waiting or running:
        preempted, i = False, 0
        while i < len(running):  # the running calls, oldest first; the newest give way
            c = running[i]
            n = min(chunk_tokens, c.req.num_tokens - c.req.num_computed_tokens)
            if kv.allocate_slots(c.req, n):
                c.scheduled = n
                i += 1
                continue
            victim = running.pop()  # (c itself when it is the newest)
            victim.appended = victim.req.num_tokens - len(victim.prompt)
            kv.free(victim.req, retain=False)
            victim.req, victim.scheduled = None, 0
            waiting.appendleft(victim)
            st.preemptions += 1
            preempted = True
        while waiting and not preempted:  # admission, in arrival order
            c = waiting[0]
            if c.req is None:
                c.req = Request(f"c{next(ids)}", c.prompt + c.reply[: c.appended],
                                SamplingParams(max_tokens=max(1, len(c.reply))))
            hits, num_hit = kv.get_computed_blocks(c.req)
            n = min(chunk_tokens, c.req.num_tokens - num_hit)
            if not kv.allocate_slots(c.req, n, hits):
                break
            c.req.num_computed_tokens = num_hit
            if not c.admitted:
                c.admitted = True
                st.hit_tokens += num_hit
                st.prompt_tokens += len(c.prompt)
            c.scheduled = n
            running.append(waiting.popleft())
        if not running:
            raise RuntimeError(f"nothing fits a pool of {num_blocks} blocks: the first waiting call has "
                               f"{waiting[0].req.num_tokens} tokens")
        held = num_blocks - kv.num_free_blocks
        st.steps += 1
        st.held_blocks += held
        st.stored_tokens += sum(c.req.num_computed_tokens + c.scheduled for c in running)
        if held > snapshot_at:
            snapshot_at = int(held * SNAPSHOT_GROWTH) + 1
            st.snapshot = [list(c.req.block_ids) for c in running]
        still = []
        for c in running:  # the step's forward, then the sampled token
            req = c.req
            req.num_computed_tokens += c.scheduled
            c.scheduled = 0
            kv.cache_blocks(req)
            done = False
            if req.num_computed_tokens == req.num_tokens:
                k = req.num_tokens - len(c.prompt)  # reply tokens appended so far
                if k < len(c.reply):
                    req.append_token(c.reply[k])
                    k += 1
                done = k == len(c.reply)
            if not done:
                still.append(c)
                continue
            _count_table(st, req.block_ids)
            kv.free(req)
            st.calls += 1
            if todo[c.program]:
                waiting.append(todo[c.program].popleft())
        running = still
    if kv.num_free_blocks != num_blocks or any(kv.pool.ref_cnt):
        raise AssertionError(f"{num_blocks - kv.num_free_blocks} blocks still held after the replay")
    st.evictions, st.run_blocks = kv.stats.evictions, kv.stats.run_blocks
    return st


def _count_table(st: ReplayStats, table: list[int]) -> None:
    adjacent = sum(1 for a, b in zip(table, table[1:]) if b == a + 1)
    st.table_entries += len(table) - 1
    st.adjacent_entries += adjacent
    st.table_runs += len(table) - adjacent
