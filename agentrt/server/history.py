"""The live page's charts: the server's state sampled once a second, the last 15 minutes kept in a ring
(bounded: `seconds` samples), served by `GET /v1/stats/history` (`?since=` for the samples after a time).

A sample: output tokens/s over the second before it, calls running and waiting, KV blocks in use per
tier (the engine's pool, and the host and disk tiers when on), the prefix hit rate over the second
(hit tokens / looked-up tokens; None when nothing was looked up), and programs by state (running now;
ended ones in the process table by how they ended).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Any

import anyio

logger = logging.getLogger("agentrt.server")


@dataclass(slots=True)
class Sample:
    t: float  # epoch s
    tokens_per_s: float  # output tokens streamed per second since the sample before
    running: int  # calls running
    waiting: int  # calls waiting
    kv_blocks: dict[str, int]  # blocks in use per tier: "pool" (the engine's, T0), "host", "disk"
    kv_blocks_total: int  # the pool's size
    prefix_hit_rate: float | None  # since the sample before; None: no prompt tokens looked up
    programs: dict[str, int]  # programs by state


class History:
    """A ring of `Sample`s, one per `interval_s`, `seconds` long."""

    def __init__(self, seconds: float = 900.0, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.samples: collections.deque[Sample] = collections.deque(maxlen=max(1, round(seconds / interval_s)))
        self._last: tuple[float, int, int, int] | None = None  # monotonic time, tokens, queries, hits

    def add(self, st: Any, stats: Any) -> Sample:
        """Sample the runtime's process table and an engine stats snapshot now."""
        rt = st.runtime
        now = time.monotonic()
        kv = stats.kv
        tokens, queries, hits = rt.programs.num_output_tokens, kv.prefix_queries_tokens, kv.prefix_hit_tokens
        rate, hit_rate = 0.0, None
        if self._last is not None:
            t0, tok0, q0, h0 = self._last
            if now > t0:
                rate = max(0, tokens - tok0) / (now - t0)
            if queries > q0:
                hit_rate = (hits - h0) / (queries - q0)
        self._last = (now, tokens, queries, hits)
        states: dict[str, int] = {}
        for p in rt.programs:
            states[p.state] = states.get(p.state, 0) + 1
        blocks = {"pool": kv.num_blocks - kv.num_free_blocks, **{k: v.blocks for k, v in kv.tiers.items()}}
        sample = Sample(time.time(), rate, stats.num_running, stats.num_waiting, blocks, kv.num_blocks, hit_rate,
                        states)
        self.samples.append(sample)
        return sample

    def since(self, t: float | None) -> list[Sample]:
        return [s for s in self.samples if t is None or s.t > t]

    async def sample_periodically(self, st: Any) -> None:
        while True:
            try:
                self.add(st, await st.runtime.engine_stats())
            except Exception:  # a failed sample leaves a hole in the chart, never stops the server
                logger.exception("live charts: sampling the engine failed")
            await anyio.sleep(self.interval_s)
