"""`agentrt run-batch -i IN.jsonl -o OUT.jsonl`: an OpenAI Batch API input file, processed offline
(vLLM's `run-batch`).

Each input line is `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}`;
each output line is `{"id": "batch_req_...", "custom_id": ..., "response": {"status_code", "request_id",
"body"}, "error": null}`. The endpoints are not re-implemented: the server app (`create_app`) runs in
this process, its lifespan entered, and every line is one request to it through httpx's ASGI transport,
so a line gets exactly what the same request over HTTP gets, errors included (a 400 is a response with
that status and the server's error body). A line that is no request at all (not JSON, no string
`custom_id`, a `custom_id` seen before, a method other than POST, an unknown url, no body, `stream: true`)
gets `"response": null, "error": {"code", "message"}` naming its line number; it never stops the others.

Lines run concurrently (at most `max_concurrency` in flight; the engine batches them) and are written
in input order, each as soon as the lines before it are written. Blank lines are skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import IO, Any

import anyio
import httpx
import msgspec

from agentrt._cli_options import add_engine_options, engine_options
from agentrt._reasoning import REASONING_PARSERS
from agentrt._toolparsers import PARSER_CHOICES
from agentrt.engine.pooling import POOLING_METHODS
from agentrt.policies import POLICY_NAMES

# what the server routes, as OpenAI's Batch API names them (and vLLM's aliases of /score and /rerank)
URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/score", "/v1/rerank",
        "/score", "/rerank", "/v2/rerank")


@dataclass(slots=True)
class BatchSummary:
    """What a run did; `lines` = `ok` + `failed` + `invalid`."""

    lines: int = 0  # non-blank input lines, one output line each
    ok: int = 0  # answered with status 200
    failed: int = 0  # answered with an error status (the server's error body), or the request broke
    invalid: int = 0  # not a request (an `error` object, no response)
    seconds: float = 0.0  # from the first line read to the last line written


@dataclass(slots=True)
class _Line:
    index: int  # position among the non-blank lines: where its output line goes
    custom_id: str
    url: str
    body: Any  # sent as it is; the server validates it


class _Invalid(Exception):
    def __init__(self, code: str, message: str, custom_id: str | None) -> None:
        super().__init__(message)
        self.code, self.custom_id = code, custom_id


def parse_line(raw: bytes, line_no: int, index: int, seen: set[str]) -> _Line:
    """One input line as a request, or `_Invalid` saying what is wrong with it. A valid `custom_id`
    joins `seen` even when the rest of the line is wrong, so no two output lines share one."""
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise _Invalid("invalid_json", f"line {line_no}: not JSON ({e})", None) from None
    if not isinstance(obj, dict):
        raise _Invalid("invalid_request", f"line {line_no}: a line must be a JSON object, got {type(obj).__name__}", None)
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise _Invalid("missing_custom_id", f"line {line_no}: `custom_id` must be a non-empty string, got {cid!r}", None)
    if cid in seen:
        raise _Invalid("duplicate_custom_id", f"line {line_no}: custom_id {cid!r} was used by an earlier line", cid)
    seen.add(cid)
    if obj.get("method") != "POST":
        raise _Invalid("invalid_method", f"line {line_no}: `method` must be \"POST\", got {obj.get('method')!r}", cid)
    url = obj.get("url")
    if url not in URLS:
        raise _Invalid("invalid_url", f"line {line_no}: url {url!r} is not one of {', '.join(URLS)}", cid)
    if "body" not in obj:
        raise _Invalid("missing_body", f"line {line_no}: no `body`", cid)
    body = obj["body"]
    if isinstance(body, dict) and body.get("stream"):
        raise _Invalid("stream_not_supported", f"line {line_no}: a batch request cannot stream (`stream: true`)", cid)
    return _Line(index, cid, url, body)


def _record(custom_id: str | None, response: dict[str, Any] | None = None,
            error: dict[str, str] | None = None) -> bytes:
    return msgspec.json.encode({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                                "response": response, "error": error}) + b"\n"


class _OrderedWriter:
    """Writes records in input order: a record waits until every record before it is written."""

    def __init__(self, write: Callable[[bytes], Awaitable[None]]) -> None:
        self._write = write
        self._pending: dict[int, bytes] = {}
        self._next = 0  # index of the next record to write
        self._lock = anyio.Lock()

    async def put(self, index: int, record: bytes) -> None:
        self._pending[index] = record
        async with self._lock:
            run = []
            while self._next in self._pending:
                run.append(self._pending.pop(self._next))
                self._next += 1
            if run:
                await self._write(b"".join(run))


class _Progress:
    """`done/read` on stderr: rewritten in place on a terminal, a line every `interval_s` otherwise."""

    def __init__(self, stream: IO[str] | None, interval_s: float | None = None) -> None:
        self.stream = stream
        self.tty = stream is not None and stream.isatty()
        self.interval_s = interval_s if interval_s is not None else (0.1 if self.tty else 10.0)
        self._last = -math.inf

    def update(self, done: int, read: int, reading: bool) -> None:
        now = time.monotonic()
        if self.stream is None or now - self._last < self.interval_s:
            return
        self._last = now
        text = f"agentrt run-batch: {done}/{read}{'+' if reading else ''} requests done"
        self.stream.write(f"\r{text}" if self.tty else text + "\n")
        self.stream.flush()

    def close(self, done: int, read: int) -> None:
        """The final count in place on a terminal (off one, the caller's summary line says it)."""
        if self.tty:
            self._last = -math.inf
            self.update(done, read, False)
            self.stream.write("\n")


async def run_batch(client: httpx.AsyncClient, lines: AsyncIterable[bytes], write: Callable[[bytes], Awaitable[None]],
                    *, max_concurrency: int = 64, progress: _Progress | None = None) -> BatchSummary:
    """Send each line of `lines` (a batch input file's raw lines) to the app behind `client`, at most
    `max_concurrency` at once, and `write` the output records in input order."""
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency!r}")
    progress = progress or _Progress(None)
    summary = BatchSummary()
    writer = _OrderedWriter(write)
    slots = anyio.Semaphore(max_concurrency)
    reading = True
    t0 = time.perf_counter()

    async def done(index: int, record: bytes, outcome: str) -> None:
        setattr(summary, outcome, getattr(summary, outcome) + 1)
        await writer.put(index, record)
        progress.update(summary.ok + summary.failed + summary.invalid, summary.lines, reading)

    async def send(line: _Line) -> None:
        try:
            r = await client.post(line.url, json=line.body)
        except Exception as e:  # noqa: BLE001 (a line that breaks the transport must not stop the others)
            record = _record(line.custom_id, error={"code": "internal_error", "message": f"{type(e).__name__}: {e}"})
            outcome = "failed"
        else:
            try:
                body = r.json()
            except ValueError:
                body = r.text
            response = {"status_code": r.status_code, "request_id": f"req_{uuid.uuid4().hex}", "body": body}
            record, outcome = _record(line.custom_id, response), "ok" if r.status_code == 200 else "failed"
        finally:
            slots.release()
        await done(line.index, record, outcome)

    seen: set[str] = set()
    async with anyio.create_task_group() as tg:
        line_no = 0
        async for raw in lines:
            line_no += 1
            if not raw.strip():
                continue
            index = summary.lines
            summary.lines += 1
            try:
                line = parse_line(raw, line_no, index, seen)
            except _Invalid as e:
                await done(index, _record(e.custom_id, error={"code": e.code, "message": str(e)}), "invalid")
                continue
            await slots.acquire()  # reading waits while max_concurrency lines are in flight
            tg.start_soon(send, line)
        reading = False
    summary.seconds = time.perf_counter() - t0
    progress.close(summary.lines, summary.lines)
    return summary


@contextlib.asynccontextmanager
async def in_process_client(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client to `app` in this process, its lifespan (model load, store, runtime) entered."""
    async with app.router.lifespan_context(app):
        # a 500 comes back as the server's error body rather than as the exception behind it
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:
            yield client


async def _lines(f: IO[bytes]) -> AsyncIterator[bytes]:
    async for raw in anyio.wrap_file(f):  # each read in a worker thread: a slow pipe never stalls the loop
        yield raw


async def _run(config: Any, source: IO[bytes], output: str, out: IO[bytes], max_concurrency: int | None,
               progress: _Progress) -> BatchSummary:
    from agentrt.server import create_app

    print("agentrt run-batch: loading the model", file=sys.stderr, flush=True)
    app = create_app(config)
    async with in_process_client(app) as client:
        if max_concurrency is None:  # enough that the engine's batch stays full while answers are written
            max_concurrency = 2 * app.state.server.runtime.engine_info.max_num_seqs
        with contextlib.ExitStack() as stack:
            sink = anyio.wrap_file(out if output == "-" else stack.enter_context(_open(output, "wb")))

            async def write(data: bytes) -> None:
                await sink.write(data)
                await sink.flush()

            return await run_batch(client, _lines(source), write, max_concurrency=max_concurrency, progress=progress)


def _open(path: str, mode: str) -> IO[bytes]:
    try:
        return open(path, mode)  # noqa: SIM115 (closed by the caller's ExitStack)
    except OSError as e:
        what = "input" if "r" in mode else "output"
        raise ValueError(f"cannot open the {what} file {path!r}: {e.strerror or e}") from None


def _command(a: argparse.Namespace) -> int:
    from agentrt.server import ServerConfig
    from agentrt.server.startup import check_startup

    # everything is checked, and the input opened, before the model loads
    if a.max_concurrency is not None and a.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {a.max_concurrency}")
    if a.output_file != "-":
        parent = os.path.dirname(os.path.abspath(a.output_file))
        if os.path.isdir(a.output_file) or not os.path.isdir(parent):
            raise ValueError(f"cannot write the output file {a.output_file!r}: "
                             f"{'it is a directory' if os.path.isdir(a.output_file) else 'no such directory'}")
        if a.input_file != "-" and os.path.exists(a.output_file) and os.path.exists(a.input_file) \
                and os.path.samefile(a.input_file, a.output_file):
            raise ValueError(f"the output file {a.output_file!r} is the input file")
    config = ServerConfig(
        model=a.model, policy=a.policy, engine=engine_options(a), db=a.db, served_model_name=a.served_model_name,
        chat_template=a.chat_template, trust_request_chat_template=a.trust_request_chat_template,
        exclude_tools_when_tool_choice_none=a.exclude_tools_when_tool_choice_none,
        reasoning_parser=a.reasoning_parser, tool_call_parser=a.tool_call_parser, pooling=a.pooling,
        lora_modules=a.lora_modules, max_waiting=sys.maxsize,  # run_batch bounds what is in flight; a 429 would only lose lines
    )
    with contextlib.ExitStack() as stack:
        if a.input_file == "-":
            source = sys.stdin.buffer
        else:
            if os.path.isdir(a.input_file):
                raise ValueError(f"cannot read the input file {a.input_file!r}: it is a directory")
            source = stack.enter_context(_open(a.input_file, "rb"))
        check_startup(config)  # the model, its sampling defaults, the database: before the load, naming the flag
        sys.stdout.flush()
        out = sys.stdout.buffer
        # with `-o -` stdout carries the records alone: anything else printed goes to stderr
        try:
            with contextlib.redirect_stdout(sys.stderr):
                s = anyio.run(_run, config, source, a.output_file, out, a.max_concurrency, _Progress(sys.stderr))
        except KeyboardInterrupt:
            print("\nagentrt run-batch: interrupted; the output holds the first lines, in input order",
                  file=sys.stderr)
            return 130
    where = "stdout" if a.output_file == "-" else a.output_file
    print(f"agentrt run-batch: {s.lines} lines: {s.ok} ok, {s.failed} failed, {s.invalid} invalid; "
          f"{s.seconds:.1f} s; written to {where}", file=sys.stderr)
    return 0


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run-batch", help="process an OpenAI Batch API input file (JSONL) offline, as vLLM's run-batch",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-i", "--input-file", required=True, metavar="FILE", help="the batch input file; - for stdin")
    p.add_argument("-o", "--output-file", required=True, metavar="FILE", help="the output file; - for stdout")
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None,
                   help="the `model` the lines' bodies name (default: the model file's name)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="lines in flight at most (default: twice the engine's --max-num-seqs)")
    p.add_argument("--policy", default="plas", choices=POLICY_NAMES)
    p.add_argument("--db", default="none", help="SQLAlchemy URL to record the calls in (default: none, no records)")
    p.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                   help="Jinja chat template, or a path to one, for every chat call (default: the model's)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a line's body bring its own chat_template")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="leave the tools out of the prompt of a call with tool_choice 'none'")
    p.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help=f"split thinking from the answer (one of {', '.join(sorted(REASONING_PARSERS))})")
    p.add_argument("--tool-call-parser", default="auto", metavar="NAME",
                   help="the format tool calls are read in (one of " + ", ".join(PARSER_CHOICES) + ")")
    p.add_argument("--pooling", default=None, choices=POOLING_METHODS, help="how /v1/embeddings pools hidden states")
    add_engine_options(p)
    p.set_defaults(fn=_command)
