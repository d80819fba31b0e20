"""The runtime observer behind the server: program and call records to the store, call and
program figures to the metrics. Runs on the event loop and never blocks: the store queues writes
for its own thread. `open_store` opens the server's records at start-up."""

from __future__ import annotations

import logging
import time

import anyio

from agentrt._call import CallSummary
from agentrt._process_table import ProgramInfo
from agentrt._runtime import RuntimeObserver
from agentrt.server.config import ServerConfig
from agentrt.server.metrics import Metrics
from agentrt.server.store import CallRecord, ProgramRecord, Store, default_url
from agentrt.server.store_reads import INTERRUPTED

logger = logging.getLogger("agentrt.server")


def open_store(config: ServerConfig) -> Store | None:
    """The server's records (None with `--db none`), started, with what its previous run left open closed.

    A server owns its database (by default its own SQLite file per served model, store.default_url): the
    programs recorded as running there belong to a run of this server that was killed (SIGKILL, power loss)
    before it could end them, so they become `interrupted`, ended at the time this start found them.
    Blocking: run it in a worker thread."""
    if (config.db or "").lower() == "none":
        return None
    store = Store(config.db or default_url(config.model_id()))
    store.start()
    closed = store.interrupt_running(time.time())
    if closed:
        logger.warning("%r: %d programs a previous run left running are now %r", store, closed, INTERRUPTED)
    return store


def wall_time(monotonic_t: float) -> float:
    """A `time.monotonic()` instant as unix time."""
    return time.time() - (time.monotonic() - monotonic_t)


def program_record(info: ProgramInfo, policy: str) -> ProgramRecord:
    return ProgramRecord(
        program_id=info.program_id, owner=info.owner, name=info.name, parent_id=info.parent_id, state=info.state,
        policy=policy, created_at=wall_time(info.start_time),
        ended_at=None if info.end_time is None else wall_time(info.end_time), calls_done=info.calls_done,
        service_s=info.service_s, wait_s=info.wait_s, num_prompt_tokens=info.num_prompt_tokens,
        num_output_tokens=info.num_output_tokens, error=info.error,
    )


class Recorder(RuntimeObserver):
    def __init__(self, store: Store | None, metrics: Metrics, policy: str, max_programs_kept: int) -> None:
        self.store = store
        self.metrics = metrics
        self.policy = policy
        self.max_programs_kept = max_programs_kept
        self.replica: str | None = None  # the replica's id under serve --replicas (its calls' records name it)

    def program_started(self, info: ProgramInfo) -> None:
        if self.store is not None:
            self.store.put_program(program_record(info, self.policy))

    def program_ended(self, info: ProgramInfo) -> None:
        latency = info.latency_s
        if latency is not None:
            self.metrics.observe_program_end(latency)
        if self.store is not None:
            self.store.put_program(program_record(info, self.policy))

    def call_ended(self, s: CallSummary) -> None:
        if s.finish_reason == "error":
            self.metrics.observe_failure()
        else:  # finished, or aborted (by its client or its program's end)
            self.metrics.observe_call(s.ttft_s, s.token_gaps_s, s.e2e_s, s.num_prompt_tokens, s.num_output_tokens,
                                      s.finish_reason or "abort")
        if self.store is not None:
            self.store.put_call(CallRecord(
                request_id=s.request_id, program_id=s.program_id, thread_id=s.thread_id, kind=s.kind,
                arrival_at=s.arrival_at, first_token_s=s.ttft_s, finished_at=s.arrival_at + s.e2e_s,
                latency_s=s.e2e_s, num_prompt_tokens=s.num_prompt_tokens, num_output_tokens=s.num_output_tokens,
                finish_reason=s.finish_reason, error=s.error, policy=self.policy, service_s=s.service_s,
                queued_s=s.wait_s if s.scheduled else None, num_cached_tokens=s.num_cached_tokens,
                num_tier_loaded_tokens=s.num_tier_loaded_tokens,
                preemptions=[[a, b] for a, b in s.preemptions] or None, pin_ttl_s=s.pin_ttl_s, tool=s.tool,
                priority=s.priority, replica=self.replica,
            ))

    async def prune_periodically(self, every_s: float = 300.0) -> None:
        """Keep the database bounded: a server runs for weeks."""
        while self.store is not None:
            await anyio.to_thread.run_sync(self.store.prune, self.max_programs_kept)
            await anyio.sleep(every_s)
