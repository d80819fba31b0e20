"""OpenTelemetry traces of programs: a span per program, a child span per LLM call, a span per tool gap, sent
to an OTLP/HTTP endpoint (`agentrt serve --otlp-traces-endpoint URL`, `Runtime(trace=URL)`).

    tracer = OtlpTracer("http://collector:4318", table, model="tiny", policy="plas")
    runtime.observers.append(tracer)          # it hears of every call's and program's end
    ...
    tracer.shutdown()                          # flushes

Spans follow the OpenTelemetry GenAI semantic conventions where they apply: the program is an agent
invocation (`invoke_agent {name}`: gen_ai.agent.name / .id, gen_ai.conversation.id), each call a model call
(`chat {model}`, `text_completion {model}`: gen_ai.request.model, gen_ai.usage.input_tokens /
output_tokens / cache_read.input_tokens, gen_ai.response.finish_reasons, gen_ai.response.id), each gap
between two calls of a thread a tool execution (`execute_tool {tool}`, gen_ai.tool.name) when the runtime
was told the tool, else `program_code`. A call's phases are its events (`queued`, `scheduled` = prefill
starts, `first_token` = decode starts, `preempted`, `rescheduled`) and vLLM's latency attributes
(gen_ai.latency.time_in_queue, ...); what only agentrt knows is under `agentrt.*` (tier-loaded tokens,
policy, priority class, pin TTL, preemptions, replica). A program whose first call carried a W3C
`traceparent` is a child of the caller's span, in the caller's trace.

Spans are made when their call or program ends, with the recorded times, from a runtime observer: with
tracing off there is no observer and nothing is imported (`opentelemetry-sdk` and
`opentelemetry-exporter-otlp-proto-http` are the `otel` extra).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from agentrt._programs import RuntimeObserver
from agentrt._timeline import call_times

if TYPE_CHECKING:
    from agentrt._call import CallSummary
    from agentrt._process_table import ProcessTable, ProgramInfo

logger = logging.getLogger("agentrt.tracing")

_OPERATION = {"chat": "chat", "responses": "chat", "messages": "chat"}  # else text_completion


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of `endpoint`: as given when it has a path, else with `/v1/traces` (as
    OTEL_EXPORTER_OTLP_ENDPOINT is read). ValueError naming a URL that is not http(s)."""
    parts = urlsplit(endpoint) if isinstance(endpoint, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"the OTLP traces endpoint must be an http(s) URL, got {endpoint!r}")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


def _ns(t: float) -> int:
    return int(t * 1e9)


@dataclass(slots=True)
class _Program:
    span: Any
    context: Any  # the span's context, parent of its calls' spans
    thread_ends: dict[str, float] = field(default_factory=dict)  # thread id -> its latest call's end (epoch s)


class OtlpTracer(RuntimeObserver):
    """A runtime observer that exports each program's spans; see the module docstring. `table`: the runtime's
    process table (a call's program is looked up there); `replica`: set by a Ray replica."""

    def __init__(self, endpoint: str, table: ProcessTable, *, model: str, policy: str, service_name: str = "agentrt",
                 exporter: Any = None) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise ImportError(f"tracing needs the otel extra: pip install 'agentrt[otel]' (no module {e.name!r})") \
                from None
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=traces_url(endpoint))
        self.endpoint = endpoint
        self.exporter = exporter
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        self.tracer = self.provider.get_tracer("agentrt")
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        self.table = table
        self.model = model
        self.policy = policy
        self.replica: str | None = None
        self._programs: dict[str, _Program] = {}

    # --- observer -------------------------------------------------------------------------------
    def call_ended(self, s: CallSummary) -> None:
        info = self.table.get(s.program_id)
        if info is None:
            return
        prog = self._program(info)
        c = call_times(s, self.replica)
        end = c.finished_at or c.arrival_at
        thread = c.thread_id or ""
        last = prog.thread_ends.get(thread)
        if last is not None and c.arrival_at > last:
            name = f"execute_tool {c.tool}" if c.tool else "program_code"
            attrs = {"gen_ai.operation.name": "execute_tool", "agentrt.thread.id": thread}
            if c.tool:
                attrs["gen_ai.tool.name"] = c.tool
            gap = self.tracer.start_span(name, context=prog.context, start_time=_ns(last), attributes=attrs)
            gap.end(end_time=_ns(c.arrival_at))
        prog.thread_ends[thread] = max(end, last or end)
        op = _OPERATION.get(s.kind, "text_completion")
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": op, "gen_ai.provider.name": "agentrt", "gen_ai.request.model": self.model,
            "gen_ai.response.model": self.model, "gen_ai.response.id": c.request_id,
            "gen_ai.conversation.id": s.program_id, "gen_ai.usage.input_tokens": c.num_prompt_tokens,
            "gen_ai.usage.output_tokens": c.num_output_tokens,
            "gen_ai.usage.cache_read.input_tokens": c.num_cached_tokens,
            "gen_ai.response.finish_reasons": [c.finish_reason or "abort"],
            "gen_ai.latency.e2e": end - c.arrival_at,
            "agentrt.program.id": s.program_id, "agentrt.thread.id": thread, "agentrt.call.kind": s.kind,
            "agentrt.policy": self.policy, "agentrt.priority": c.priority,
            "agentrt.tier_loaded_tokens": c.num_tier_loaded_tokens, "agentrt.preemptions": len(c.preemptions or ()),
            "agentrt.service_s": c.service_s,
        }
        if c.queued_s is not None:
            attrs["gen_ai.latency.time_in_queue"] = c.queued_s
        if c.first_token_s is not None:
            attrs["gen_ai.latency.time_to_first_token"] = c.first_token_s
            attrs["gen_ai.latency.time_in_model_decode"] = end - c.arrival_at - c.first_token_s
            if c.queued_s is not None:
                attrs["gen_ai.latency.time_in_model_prefill"] = c.first_token_s - c.queued_s
        if c.pin_ttl_s is not None:
            attrs["agentrt.pin_ttl_s"] = c.pin_ttl_s
        if c.tool:
            attrs["agentrt.after_tool"] = c.tool
        if c.replica:
            attrs["agentrt.replica"] = c.replica
        if s.error:
            attrs["error.type"] = "call_failed"
        span = self.tracer.start_span(f"{op} {self.model}", context=prog.context, start_time=_ns(c.arrival_at),
                                      attributes=attrs)
        span.add_event("queued", timestamp=_ns(c.arrival_at))
        if c.queued_s is not None:
            span.add_event("scheduled", timestamp=_ns(c.arrival_at + c.queued_s))
        if c.first_token_s is not None:
            span.add_event("first_token", timestamp=_ns(c.arrival_at + c.first_token_s))
        for at, back in c.preemptions or ():
            span.add_event("preempted", timestamp=_ns(c.arrival_at + at))
            if back is not None:
                span.add_event("rescheduled", timestamp=_ns(c.arrival_at + back))
        if s.error:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, s.error))
        span.end(end_time=_ns(end))

    def program_ended(self, info: ProgramInfo) -> None:
        prog = self._program(info)
        del self._programs[info.program_id]
        to_wall = time.time() - time.monotonic()
        span = prog.span
        span.set_attributes({
            "agentrt.program.state": info.state, "agentrt.calls": info.calls_done,
            "agentrt.threads": info.num_threads, "agentrt.service_s": info.service_s, "agentrt.wait_s": info.wait_s,
            "agentrt.critical_path_s": info.critical_path_s, "gen_ai.usage.input_tokens": info.num_prompt_tokens,
            "gen_ai.usage.output_tokens": info.num_output_tokens,
            "gen_ai.usage.cache_read.input_tokens": info.num_prefix_hit_tokens,
        })
        if info.state in ("failed",):
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, info.error or info.state))
        end = info.end_time if info.end_time is not None else time.monotonic()
        span.end(end_time=_ns(end + to_wall))

    def _program(self, info: ProgramInfo) -> _Program:
        prog = self._programs.get(info.program_id)
        if prog is None:
            caller = self.table.get(info.parent_id) if info.parent_id is not None else None
            if caller is not None and (caller.program_id in self._programs or caller.state == "running"):
                parent = self._program(caller).context  # a program called by another: a child of its span
            elif info.traceparent:
                parent = self._propagator.extract({"traceparent": info.traceparent})
            else:
                parent = None
            attrs = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": info.name,
                     "gen_ai.agent.id": info.program_id, "gen_ai.conversation.id": info.program_id,
                     "gen_ai.request.model": self.model, "agentrt.policy": self.policy,
                     "agentrt.priority": info.priority}
            if info.parent_id is not None:
                attrs["agentrt.program.parent_id"] = info.parent_id
            if self.replica:
                attrs["agentrt.replica"] = self.replica
            start = info.start_time + time.time() - time.monotonic()
            span = self.tracer.start_span(f"invoke_agent {info.name}", context=parent, start_time=_ns(start),
                                          attributes=attrs)
            prog = self._programs[info.program_id] = _Program(span, self._trace.set_span_in_context(span))
        return prog

    # --- lifetime -------------------------------------------------------------------------------
    def force_flush(self, timeout_s: float = 10.0) -> bool:
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """End the spans of programs still open (the runtime stops) and flush."""
        for pid in list(self._programs):
            info = self.table.get(pid)
            if info is not None:
                self.program_ended(info)
        self._programs.clear()
        self.provider.shutdown()
