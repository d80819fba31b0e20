"""`Call`: one LLM call of a program, from submission to its final output.

    call = runtime.submit(prompt_ids, params, program_id="p1")   # bad input raises here
    async with call:                                             # leaving early aborts it
        async for delta in call:                                 # engine StreamDeltas
            ...
        output = await call.result()

Submission is synchronous, so a caller (the HTTP server) learns of bad input before it has sent
anything. Whatever way the call ends (finished, failed, cancelled, closed early) its bookkeeping
runs exactly once: the engine request is aborted if still live, and the runtime's program manager hears
of its end in one report (`ProgramManager.call_ended`: the process table, the in-flight map, retention,
the observers).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from agentrt._errors import CallAbortedError, CallFailedError
from agentrt._process_table import CallRecord, ProcessTable, ProgramInfo
from agentrt.engine.async_engine import EngineError, RequestStream
from agentrt.engine.outputs import RequestOutput, StreamDelta

if TYPE_CHECKING:
    from agentrt._program import ProgramHandle


@dataclass(slots=True)
class CallSummary:
    """What observers (the server's store and metrics) learn when a call ends."""

    request_id: str
    program_id: str
    thread_id: str
    kind: str  # "chat" | "completion" | "generate" | ...
    arrival_at: float  # unix time of submission
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"; None if it never finished
    ttft_s: float | None  # submission -> first token
    e2e_s: float  # submission -> end
    token_gaps_s: list[float] = field(default_factory=list)  # time between successive deltas with tokens
    service_s: float = 0.0  # executor time of the call
    wait_s: float = 0.0  # queueing time, arrival -> first scheduled
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_tier_loaded_tokens: int = 0  # of the prompt, tokens the KV tiers loaded instead of recomputing them
    preemptions: list[tuple[float, float | None]] = field(default_factory=list)  # (preempted, scheduled again or
    # None), seconds from arrival
    priority: int = 0  # its scheduling class (SamplingParams.priority)
    tool: str | None = None  # the tool its program ran between its previous call and this one, if told
    pin_ttl_s: float | None = None  # the TTL its program's KV was pinned for at its end (None: no retention)
    scheduled: bool = False  # it reached the engine's running set (wait_s is then its queueing time)


class CallReports(Protocol):
    """Whom a call reports to: the runtime's program manager (`agentrt._programs.ProgramManager`), which
    imports this module; a call knows it only by this face."""

    table: ProcessTable  # hears of the call's first token (`call_running`)

    def abort_call(self, request_id: str) -> None:
        """The call left early: abort its engine request."""

    def call_ended(self, call: Call, summary: CallSummary, num_prefix_hit_tokens: int) -> None:
        """The call's request left the engine (once)."""


class Call:
    """An in-flight call; see the module docstring."""

    def __init__(
        self, programs: CallReports, info: ProgramInfo, thread_id: str, request_id: str, kind: str,
        stream: RequestStream, record: CallRecord, num_prompt_tokens: int,
    ) -> None:
        self._programs = programs  # the runtime's program manager, which hears of the call's first token and end
        self.info = info
        self.program_id = info.program_id
        self.thread_id = thread_id
        self.request_id = request_id
        self.kind = kind
        self.num_prompt_tokens = num_prompt_tokens
        self._stream = stream
        self.record = record  # in the process table
        self._t0 = time.monotonic()
        self._wall0 = time.time()
        self._last_token_t: float | None = None
        self._ttft: float | None = None
        self._gaps: list[float] = []
        self._generated = 0
        self.output: RequestOutput | None = None  # the final output, once `result` returned it
        self._error: str | None = None
        self.closed = False  # close() ran
        self.one_call: ProgramHandle | None = None  # set when the call is a program of its own
        self.model: str | None = None  # the LoRA adapter it runs with (agentrt._lora); None: the base model

    # --- consuming -------------------------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[StreamDelta]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[StreamDelta]:
        try:
            async for delta in self._stream:
                if delta.new_token_ids:
                    now = time.monotonic()
                    if self._ttft is None:
                        self._ttft = now - self._t0
                        self._programs.table.call_running(self.info, self.record)
                    elif self._last_token_t is not None and len(self._gaps) < 100_000:
                        self._gaps.append(now - self._last_token_t)
                    self._last_token_t = now
                    self._generated += len(delta.new_token_ids)
                    self._programs.table.num_output_tokens += len(delta.new_token_ids)
                yield delta
        except (ValueError, TypeError, EngineError) as e:  # the engine failed or rejected the request
            self._error = str(e)
            raise CallFailedError(str(e), program_id=self.program_id, request_id=self.request_id) from None

    async def result(self) -> RequestOutput:
        """Drain the call and return its output; `CallAbortedError` / `CallFailedError` if it did
        not finish normally."""
        if self.output is None:
            async for _ in self._deltas():
                pass
            try:
                self.output = await self._stream.result()
            except (ValueError, TypeError, EngineError) as e:
                self._error = str(e)
                raise CallFailedError(str(e), program_id=self.program_id, request_id=self.request_id) from None
            finally:
                if self.output is None:
                    self.close()
        out = self.output
        self.close()
        reason = out.outputs[0].finish_reason if out.outputs else "abort"
        if reason == "abort":
            raise CallAbortedError("the call was aborted", program_id=self.program_id, request_id=self.request_id)
        errors = [o.error for o in out.outputs if o.finish_reason == "error"]
        if errors:
            raise CallFailedError(errors[0] or "the engine failed the call", program_id=self.program_id,
                                  request_id=self.request_id)
        return out

    def abort(self) -> None:
        """Stop generating; the stream ends with finish_reason "abort"."""
        if not self.closed:
            self._programs.abort_call(self.request_id)

    # --- ending ----------------------------------------------------------------------------
    async def __aenter__(self) -> Call:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release everything the call holds (idempotent); aborts the request if still live."""
        if self.closed:
            return
        self.closed = True
        out = self.output
        if out is None:
            self._programs.abort_call(self.request_id)
        m = out.metrics if out is not None else None
        wait = 0.0 if m is None or m.first_scheduled_time is None else max(0.0, m.first_scheduled_time - m.arrival_time)
        service = m.service_s if m is not None else 0.0
        reason = None
        if out is not None and out.outputs:
            reasons = [o.finish_reason for o in out.outputs]
            reason = "error" if "error" in reasons else reasons[0]
            self._error = self._error or next((o.error for o in out.outputs if o.error), None)
        elif out is None:
            reason = "error" if self._error else "abort"
        rec = self.record
        summary = CallSummary(
            self.request_id, self.program_id, self.thread_id, self.kind, self._wall0, self.num_prompt_tokens,
            self._generated, reason, self._ttft, time.monotonic() - self._t0, self._gaps, service, wait,
            self._error, priority=rec.priority, tool=rec.tool, pin_ttl_s=rec.pin_ttl_s,
        )
        if m is not None:
            summary.num_cached_tokens, summary.num_tier_loaded_tokens = m.num_prefix_hit_tokens, m.num_tier_loaded_tokens
            summary.scheduled = m.first_scheduled_time is not None
            if m.preemptions:
                summary.preemptions = [(at - m.arrival_time, None if back is None else back - m.arrival_time)
                                       for at, back in m.preemptions]
        self._programs.call_ended(self, summary, summary.num_cached_tokens)
