"""Prometheus metrics of one server, named after vLLM's (`vllm:` -> `agentrt:`).

Each `Metrics` owns its registry, so several servers (or tests) in one process do not clash.
Per-call numbers are pushed by the server as calls end (`observe_call`, `observe_failure`,
`observe_program_end`); engine state is pulled at scrape time from `state_fn` (or pushed with
`set_engine_state`). The engine reports prefix-cache and preemption numbers as running totals;
the counters advance by the growth since the previous report, so they equal the highest total
seen. Counters appear in the exposition with prometheus_client's `_total` suffix
(`agentrt:prompt_tokens_total`), as vLLM's do. With LoRA on, `agentrt:lora_requests_info` is vLLM's
info gauge: one series whose labels name the adapters running and waiting, its value the scrape's time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

logger = logging.getLogger(__name__)

# a CPU server: first tokens in ms to minutes under load, programs up to hours
_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                  0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                  60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
_PROGRAM_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0,
                      1800.0, 3600.0, 7200.0)


@dataclass(slots=True)
class EngineState:
    """What `state_fn` returns: the engine's state at scrape time."""

    running: int  # requests being decoded
    waiting: int  # requests queued
    kv_usage: float  # fraction of KV blocks in use, 0..1
    prefix_queries_tokens: int  # running total: prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int  # running total: of those, tokens found
    num_preemptions: int  # running total
    programs_active: int
    calls_per_level: dict[int, int] = field(default_factory=dict)  # queue level -> calls in it
    kv_pinned_blocks: int = 0  # blocks programs' pins keep across tool calls
    kv_reserved_blocks: int = 0  # blocks set aside by programs' reservations
    ttl_hits: int = 0  # running total: calls admitted while their program's pin held its prefix
    ttl_misses: int = 0  # running total: calls admitted after their program's pin expired or gave way
    pin_expiries: int = 0  # running total: pins dropped at their deadline
    recomputed_prefill_tokens: int = 0  # running total: prompt tokens a program had computed before, again
    running_seats: int = 0  # the running-set limit of the latest step (max_num_seqs unless the policy caps it)
    kv_tiers: dict[str, Any] = field(default_factory=dict)  # tier name -> its engine.kv_host.TierStats
    max_lora: int | None = None  # adapters the engine keeps loaded at most; None: LoRA off (no lora gauge)
    running_lora_adapters: str = ""  # names of the adapters running requests use, sorted, comma-joined
    waiting_lora_adapters: str = ""  # likewise for waiting requests


class Metrics:
    """`Metrics(state_fn=None)`; `render()` serves a scrape. All methods are thread-safe."""

    def __init__(self, state_fn: Callable[[], EngineState] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._state_fn = state_fn
        self._lock = threading.Lock()  # one engine-state report at a time: the running totals
        self._last_totals = [0] * 7  # prefix queries, prefix hits, preemptions, TTL hits, misses, expiries, recomputed
        self._levels_seen: set[int] = set()
        self.lora_requests_info: Gauge | None = None  # made at the first report with LoRA on
        self._lora_labels: tuple[str, str, str] | None = None  # the one label set it holds
        r = self.registry

        self.num_requests_running = Gauge("agentrt:num_requests_running", "Requests being decoded.", registry=r)
        self.num_requests_waiting = Gauge("agentrt:num_requests_waiting", "Requests waiting to be scheduled.",
                                          registry=r)
        self.kv_cache_usage_perc = Gauge("agentrt:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent.",
                                         registry=r)
        self.programs_active = Gauge("agentrt:programs_active", "Programs running.", registry=r)
        self.running_seats = Gauge("agentrt:running_seats", "Running-set limit of the latest step: max_num_seqs, "
                                   "or the policy's running cap while calls wait.", registry=r)
        self.calls_per_queue_level = Gauge("agentrt:calls_per_queue_level", "Calls in each scheduler queue level.",
                                           ["level"], registry=r)

        self.prefix_cache_queries = Counter("agentrt:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.", registry=r)
        self.prefix_cache_hits = Counter("agentrt:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                         registry=r)
        self.num_preemptions = Counter("agentrt:num_preemptions", "Preemptions of running requests.", registry=r)
        self.kv_pinned_blocks = Gauge("agentrt:kv_pinned_blocks", "KV blocks pinned for programs in a tool call.",
                                      registry=r)
        self.kv_reserved_blocks = Gauge("agentrt:kv_reserved_blocks", "KV blocks reserved for programs.", registry=r)
        self.kv_ttl_hits = Counter("agentrt:kv_ttl_hits", "Calls whose program's pinned prefix was still there.",
                                   registry=r)
        self.kv_ttl_misses = Counter("agentrt:kv_ttl_misses", "Calls whose program's pin had expired or given way.",
                                     registry=r)
        self.kv_pin_expiries = Counter("agentrt:kv_pin_expiries", "Pins dropped at their TTL deadline.", registry=r)
        self.recomputed_prefill_tokens = Counter(
            "agentrt:recomputed_prefill_tokens", "Prompt tokens a program had computed in an earlier call, computed again.",
            registry=r)
        self.prompt_tokens = Counter("agentrt:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("agentrt:generation_tokens", "Generated tokens of finished requests.",
                                         registry=r)
        self.request_success = Counter("agentrt:request_success", "Finished requests, by finish reason.",
                                       ["finished_reason"], registry=r)
        self.requests_failed = Counter("agentrt:requests_failed", "Requests ended by an error.", registry=r)

        self.time_to_first_token = Histogram("agentrt:time_to_first_token_seconds", "Time to first token.",
                                             buckets=_TTFT_BUCKETS_S, registry=r)
        self.inter_token_latency = Histogram("agentrt:inter_token_latency_seconds", "Time between output tokens.",
                                             buckets=_ITL_BUCKETS_S, registry=r)
        self.e2e_request_latency = Histogram("agentrt:e2e_request_latency_seconds", "Arrival to last token.",
                                             buckets=_E2E_BUCKETS_S, registry=r)
        self.program_latency = Histogram("agentrt:program_latency_seconds", "Program start to end.",
                                         buckets=_PROGRAM_BUCKETS_S, registry=r)

        # the KV tiers below the cache (engine.kv_tiers), labelled by tier: host (T1), disk (T2)
        self.kv_tier_blocks = Gauge("agentrt:kv_tier_blocks", "KV blocks a tier below the cache holds.", ["tier"],
                                    registry=r)
        self.kv_tier_bytes = Gauge("agentrt:kv_tier_bytes", "Bytes a tier below the KV cache holds.", ["tier"],
                                   registry=r)
        self._tier_counters = {attr: Counter(f"agentrt:kv_tier_{name}", doc, ["tier"], registry=r) for attr, name, doc in (
            ("hits", "hits", "KV blocks a prefix lookup found in the tier and loaded instead of recomputing."),
            ("demotions", "demotions", "KV blocks written to the tier."),
            ("evictions", "evictions", "KV blocks the tier dropped to make room."),
            ("skipped", "skipped", "KV blocks not written to the tier (disk full, writer backlog, write error)."),
            ("corrupt", "corrupt_files", "Truncated, corrupt or foreign files found in the tier (never served)."),
            ("prefetched", "prefetched", "KV blocks read ahead from the tier for a waiting call."),
            ("in_place", "in_place_reads", "Of the hits, KV blocks a block table read where they lie in the tier (a "
                                           "CPU engine's host tier) instead of a copy."),
            ("load_s", "load_seconds", "Seconds spent loading blocks from the tier."),
            ("write_s", "write_seconds", "Seconds spent writing blocks to the tier."),
        )}
        self._tier_totals: dict[tuple[str, str], float] = {}

    def observe_call(
        self,
        ttft_s: float | None,
        inter_token_s: Sequence[float],
        e2e_s: float,
        prompt_tokens: int,
        generation_tokens: int,
        finish_reason: str,
    ) -> None:
        """A call that finished. `ttft_s`: None if no token came; `inter_token_s`: the gap before
        each output token after the first (empty when unknown)."""
        if ttft_s is not None:
            self.time_to_first_token.observe(ttft_s)
        for gap_s in inter_token_s:
            self.inter_token_latency.observe(gap_s)
        self.e2e_request_latency.observe(e2e_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.request_success.labels(finished_reason=finish_reason).inc()

    def observe_failure(self) -> None:
        """A call that ended in an error."""
        self.requests_failed.inc()

    def observe_program_end(self, latency_s: float) -> None:
        self.program_latency.observe(latency_s)

    def set_engine_state(
        self,
        running: int,
        waiting: int,
        kv_usage: float,
        prefix_queries_tokens: int,
        prefix_hit_tokens: int,
        num_preemptions: int,
        programs_active: int,
        calls_per_level: Mapping[int, int],
    ) -> None:
        """Set the gauges; advance the counters by how much the running totals grew since the
        last report (a total below the last one is a late report and adds nothing)."""
        with self._lock:
            self._set_engine_state(EngineState(running, waiting, kv_usage, prefix_queries_tokens, prefix_hit_tokens,
                                               num_preemptions, programs_active, dict(calls_per_level)))

    def render(self, state: EngineState | None = None) -> tuple[bytes, str]:
        """The text exposition and its content type, after refreshing the engine state (`state` if given,
        else `state_fn`'s)."""
        if state is not None:
            with self._lock:
                self._set_engine_state(state)
        elif self._state_fn is not None:
            with self._lock:  # concurrent scrapes report in the order they read
                try:
                    s = self._state_fn()
                except Exception:  # a scrape still serves the last known state
                    logger.exception("metrics: state_fn failed")
                else:
                    self._set_engine_state(s)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _set_engine_state(self, s: EngineState) -> None:
        self.num_requests_running.set(s.running)
        self.num_requests_waiting.set(s.waiting)
        self.kv_cache_usage_perc.set(s.kv_usage)
        self.programs_active.set(s.programs_active)
        self.running_seats.set(s.running_seats)
        self.kv_pinned_blocks.set(s.kv_pinned_blocks)
        self.kv_reserved_blocks.set(s.kv_reserved_blocks)
        totals = (s.prefix_queries_tokens, s.prefix_hit_tokens, s.num_preemptions, s.ttl_hits, s.ttl_misses,
                  s.pin_expiries, s.recomputed_prefill_tokens)
        counters = (self.prefix_cache_queries, self.prefix_cache_hits, self.num_preemptions, self.kv_ttl_hits,
                    self.kv_ttl_misses, self.kv_pin_expiries, self.recomputed_prefill_tokens)
        for i, (total, counter) in enumerate(zip(totals, counters)):
            if total > self._last_totals[i]:
                counter.inc(total - self._last_totals[i])
                self._last_totals[i] = total
        for level in self._levels_seen - s.calls_per_level.keys():
            self.calls_per_queue_level.labels(level=str(level)).set(0)  # emptied levels read 0, not stale
        for level, n in s.calls_per_level.items():
            self.calls_per_queue_level.labels(level=str(level)).set(n)
        self._levels_seen.update(s.calls_per_level)
        for tier, st in s.kv_tiers.items():
            self.kv_tier_blocks.labels(tier=tier).set(st.blocks)
            self.kv_tier_bytes.labels(tier=tier).set(st.bytes)
            for name, counter in self._tier_counters.items():
                total, last = getattr(st, name), self._tier_totals.get((tier, name), 0)
                if total > last:
                    counter.labels(tier=tier).inc(total - last)
                    self._tier_totals[tier, name] = total
        if s.max_lora is not None:
            self._set_lora_info(str(s.max_lora), s.waiting_lora_adapters, s.running_lora_adapters)

    def _set_lora_info(self, max_lora: str, waiting: str, running: str) -> None:
        """vLLM's lora_requests_info: one series, its labels the adapters in use and its value when they were
        read (a reader takes the newest series). A changed label set replaces the old one, so the series
        stay one however adapters come and go over a server's life."""
        if self.lora_requests_info is None:
            self.lora_requests_info = Gauge(
                "agentrt:lora_requests_info", "Running stats on LoRA requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=self.registry)
        labels = (max_lora, waiting, running)
        self.lora_requests_info.labels(*labels).set_to_current_time()
        if self._lora_labels is not None and self._lora_labels != labels:
            self.lora_requests_info.remove(*self._lora_labels)
        self._lora_labels = labels
