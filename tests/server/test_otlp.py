"""`agentrt serve --otlp-traces-endpoint` (issue 52, acceptance 2): a ReAct program run through
`agentrt.connect` with a caller's `traceparent` reaches an OTLP/HTTP receiver (a small HTTP server here that
decodes the protobuf export) as one trace: the program's span a child of the caller's, a span per call
under it with the GenAI attributes and the phases as events, the gaps between calls as spans too. With the
flag off, no exporter is built."""

from __future__ import annotations

import http.server
import threading
import time

import anyio
import pytest

import agentrt
from tests.server.live import free_port, live_server, tiny_config

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed (pip install 'agentrt[otel]')")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402

from agentrt.programs.react import react  # noqa: E402

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"


class Receiver:
    """An OTLP/HTTP traces endpoint: every span of every export, with its resource's attributes."""

    def __init__(self) -> None:
        self.spans: list = []
        self.paths: list[str] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                receiver.paths.append(self.path)
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        receiver.spans.extend(ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = list(x.string_value for x in v.array_value.values) if kind == "array_value" else getattr(v, kind)
    return out


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.close()


def test_a_react_program_is_one_trace_under_the_caller_s_span(tiny_model_path, receiver):
    with live_server(tiny_config(tiny_model_path, served_model_name="tiny",
                                 otlp_traces_endpoint=receiver.url)) as s:
        assert s.state.runtime.tracer is not None

        async def run():
            async with agentrt.connect(s.url, headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}):
                return await react("What is 2 + 2?", max_steps=3, max_tokens=8)

        result = anyio.run(run)
        assert result.steps == 3
        deadline = time.monotonic() + 15
        while not any(sp.name == "invoke_agent react" for sp in receiver.spans):
            assert time.monotonic() < deadline, [sp.name for sp in receiver.spans]
            time.sleep(0.1)
    assert set(receiver.paths) == {"/v1/traces"}  # the endpoint given without a path: OTLP's traces path
    (prog,) = [sp for sp in receiver.spans if sp.name == "invoke_agent react"]
    assert prog.trace_id.hex() == CALLER_TRACE and prog.parent_span_id.hex() == CALLER_SPAN
    pa = attrs(prog)
    pid = pa["gen_ai.agent.id"]
    assert pa["gen_ai.operation.name"] == "invoke_agent" and pa["agentrt.program.state"] == "finished"
    assert pa["agentrt.calls"] == 3 and pa["agentrt.policy"] == "plas"
    mine = [sp for sp in receiver.spans if sp.trace_id == prog.trace_id and sp is not prog]
    assert all(sp.parent_span_id == prog.span_id for sp in mine)  # every other span is the program's child
    calls = sorted((sp for sp in mine if sp.name == "text_completion tiny"), key=lambda sp: sp.start_time_unix_nano)
    assert [attrs(c)["gen_ai.response.id"] for c in calls] == [f"{pid}-c{i}" for i in (1, 2, 3)]
    for c in calls:
        a = attrs(c)
        assert a["gen_ai.request.model"] == "tiny" and a["gen_ai.conversation.id"] == pid
        assert a["gen_ai.usage.input_tokens"] > 0 and 0 < a["gen_ai.usage.output_tokens"] <= 8
        assert "gen_ai.usage.cache_read.input_tokens" in a and a["agentrt.tier_loaded_tokens"] == 0
        assert a["agentrt.policy"] == "plas" and a["agentrt.priority"] == 0 and a["agentrt.preemptions"] == 0
        assert a["gen_ai.latency.time_in_queue"] >= 0 and a["gen_ai.latency.time_to_first_token"] > 0
        events = [e.name for e in c.events]
        assert events == ["queued", "scheduled", "first_token"]
        times = [e.time_unix_nano for e in c.events]
        assert c.start_time_unix_nano == times[0] <= times[1] <= times[2] <= c.end_time_unix_nano
        assert prog.start_time_unix_nano <= c.start_time_unix_nano and c.end_time_unix_nano <= prog.end_time_unix_nano
    assert attrs(calls[1])["gen_ai.usage.cache_read.input_tokens"] > 0  # the transcript grows: its prefix is cached
    gaps = [sp for sp in mine if attrs(sp)["gen_ai.operation.name"] == "execute_tool"]
    assert len(gaps) == 2  # between the three calls
    for gap, before, after in zip(gaps, calls, calls[1:]):
        assert (gap.start_time_unix_nano, gap.end_time_unix_nano) == (before.end_time_unix_nano,
                                                                      after.start_time_unix_nano)
    assert len(mine) == 5


def test_flag_off_builds_no_exporter(tiny_model_path, monkeypatch):
    from opentelemetry.exporter.otlp.proto.http import trace_exporter

    built = []
    monkeypatch.setattr(trace_exporter.OTLPSpanExporter, "__init__", lambda self, *a, **kw: built.append(a))
    with live_server(tiny_config(tiny_model_path)) as s:
        import httpx

        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
        assert r.status_code == 200
        rt = s.state.runtime
        assert rt.tracer is None and not any(type(o).__name__ == "OtlpTracer" for o in rt.observers)
    assert built == []


def test_bad_endpoint_is_refused_before_the_model_loads():
    from agentrt.server import ServerConfig

    with pytest.raises(ValueError, match="OTLP traces endpoint must be an http"):
        ServerConfig(otlp_traces_endpoint="localhost:4318")
