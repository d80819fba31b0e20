"""Serving: `agentrt serve` under streaming chat load, with the in-process engine as the peer.

    agentrt bench serve [--rates 0.25,0.5,1,1.5,2] [--duration-s 30] [--json] [--docs]
    python -m agentrt.bench.serve ...

The server runs in a subprocess (`agentrt serve --db none`, the engine options forwarded), so the
client here and the server do not share a GIL. Every request is a streaming chat call
(`/v1/chat/completions`, stream=true, include_usage), greedy, with `ignore_eos` so its output
length is exactly `max_tokens`; prompts are random vocabulary words (fixed seed), 32-256 prompt
tokens after the chat template, outputs 16-64 tokens. Each phase draws fresh prompts, so no phase
finds another's prompts in the prefix cache. Measured, in this order:

1. Low load, against `engine.AsyncEngine` in this process: requests one at a time, each prompt
   through the server and in-process (which goes first alternates), TTFT = send -> first content
   chunk through the server, add_request -> first delta with text in-process. Reported: the
   difference of the medians and the median of the per-prompt differences (the target's measure:
   prompts of 32-256 tokens make TTFT vary 5x, pairs cancel that), and, per request, the server's
   own submit -> first token (its /metrics), so client TTFT minus that is HTTP + template + SSE.
2. Saturation, against `engine.LLM.generate` in this process: the same N requests (same prompt
   token ids from the same chat template) all at once, `--repeats` pairs interleaved so drift hits
   both alike. Reported: server output tok/s / LLM.generate output tok/s (median over the pairs,
   the target's measure), and CPU time per output token of each (the server process; the client
   apart), which other tenants of a shared machine disturb less than wall time. The in-process
   engines are idle while the server works, and are freed before step 3.
3. Poisson arrivals at each `--rates` value for `--duration-s` (at most `--max-requests`): per rate
   TTFT (first content chunk), ITL (gaps between content chunks, pooled), end-to-end latency
   (p50 / p99), output tok/s and requests/s over the phase (first arrival -> last completion), and
   failed requests (non-200, an error event, no [DONE], or not exactly max_tokens tokens).
   A rate is "sustainable" when it is at most the saturated request throughput of step 2.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import numpy as np

from agentrt.bench._common import markdown_table, write_section

ROOT = Path(__file__).resolve().parent.parent
TARGET_RATIO = 0.90  # saturated server tok/s / LLM.generate tok/s, median over pairs, at least
TARGET_TTFT_MS = 10.0  # low-load TTFT, median of (server - in-process) per prompt, at most


# --- workload ---------------------------------------------------------------------------------
@dataclass(slots=True)
class Req:
    content: str  # the user message
    prompt_ids: list[int]  # its token ids under the chat template, as the server computes them
    max_tokens: int


def chat_ids(tok: Any, content: str) -> list[int]:
    """What `Runtime.chat_token_ids` computes for one user message."""
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


class Prompts:
    """Fixed-seed chat requests: random lowercase vocabulary words (one token each, mostly)."""

    def __init__(self, tok: Any, prompt_tokens: tuple[int, int], output_tokens: tuple[int, int], seed: int):
        self.tok, self.prompt_tokens, self.output_tokens, self.seed = tok, prompt_tokens, output_tokens, seed
        self.words = sorted(w[1:] for w in tok.get_vocab() if w.startswith("Ġ") and w[1:].isalpha()
                            and w[1:].islower() and len(w) >= 5)
        self.overhead = len(chat_ids(tok, ""))

    def draw(self, phase: str, n: int, max_tokens: int | None = None) -> list[Req]:
        rng = random.Random(f"{self.seed}-{phase}")  # str seeds are stable across runs
        return [self._one(rng, max_tokens) for _ in range(n)]

    def _one(self, rng: random.Random, max_tokens: int | None) -> Req:
        target = rng.randint(*self.prompt_tokens)
        words = [rng.choice(self.words) for _ in range(max(1, target - self.overhead))]
        while True:  # one word is one token but a few: trim to the target
            ids = chat_ids(self.tok, " ".join(words))
            if len(ids) <= target or len(words) == 1:
                break
            del words[-max(1, (len(ids) - target) // 2):]
        out = rng.randint(*self.output_tokens)
        return Req(" ".join(words), ids, out if max_tokens is None else max_tokens)


def poisson_arrivals(rate: float, duration_s: float, cap: int, seed: int) -> list[float]:
    rng, t, out = random.Random(f"{seed}-arrivals-{rate}"), 0.0, []
    while len(out) < cap:
        t += rng.expovariate(rate)
        if t > duration_s:
            break
        out.append(t)
    return out


# --- client -----------------------------------------------------------------------------------
@dataclass(slots=True)
class Result:
    start: float  # perf_counter at send
    end: float = 0.0  # at [DONE] (or the failure)
    ttft_s: float | None = None  # send -> first content chunk
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


def body(req: Req) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": req.content}], "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def stream_chat(client: httpx.AsyncClient, req: Req) -> Result:
    res = Result(time.perf_counter())
    last, done = None, False
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body(req)) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                now, ev = time.perf_counter(), msgspec.json.decode(line[6:])
                if "error" in ev:
                    res.error = f"error event: {ev['error'].get('message')}"
                    continue
                if any(c.get("delta", {}).get("content") for c in ev.get("choices", ())):
                    if last is None:
                        res.ttft_s = now - res.start
                    else:
                        res.itl_s.append(now - last)
                    last = now
                if ev.get("usage"):
                    res.prompt_tokens = ev["usage"]["prompt_tokens"]
                    res.output_tokens = ev["usage"]["completion_tokens"]
    except (httpx.HTTPError, msgspec.DecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.end = time.perf_counter()
    if res.error is None and not done:
        res.error = "stream ended without [DONE]"
    if res.error is None and res.output_tokens != req.max_tokens:
        res.error = f"{res.output_tokens} output tokens, expected {req.max_tokens}"
    return res


async def run_load(client: httpx.AsyncClient, reqs: list[Req], arrivals: list[float]) -> tuple[list[Result], float]:
    """Send request i at t0 + arrivals[i]; all results and the wall time t0 -> last completion."""
    results: list[Result | None] = [None] * len(reqs)
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        await anyio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
        results[i] = await stream_chat(client, reqs[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(reqs)):
            tg.start_soon(one, i)
    done = [r for r in results if r is not None]
    return done, max(r.end for r in done) - t0


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def summarize(results: list[Result], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [g for r in ok for g in r.itl_s]
    e2e = [r.end - r.start for r in ok]
    out = sum(r.output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1
    return {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok), "errors": errors,
        "wall_s": wall_s, "request_throughput": len(ok) / wall_s, "output_tok_s": out / wall_s,
        "prompt_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": out,
        "ttft_ms": {"p50": _ms(pct(ttft, 50)), "p99": _ms(pct(ttft, 99))},
        "itl_ms": {"p50": _ms(pct(itl, 50)), "p99": _ms(pct(itl, 99))},
        "e2e_s": {"p50": pct(e2e, 50), "p99": pct(e2e, 99)},
    }


def _ms(s: float | None) -> float | None:
    return None if s is None else 1000 * s


# --- the server subprocess ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server_process(a: argparse.Namespace) -> Iterator[tuple[str, subprocess.Popen]]:
    """`agentrt serve` on a free loopback port; yields (url, process); SIGTERM at the end."""
    port = free_port()
    cmd = [sys.executable, "-m", "agentrt.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--db", "none",
           "--policy", a.policy, "--log-level", "warning", "--max-waiting", str(max(256, a.max_requests))]
    for flag, value in server_engine_flags(a):
        cmd += [flag, str(value)]
    if getattr(a, "otlp_traces_endpoint", None):  # tracing on: its cost against the same run with it off
        cmd += ["--otlp-traces-endpoint", a.otlp_traces_endpoint]
    cmd += getattr(a, "extra_flags", [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield f"http://127.0.0.1:{port}", proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if proc.returncode not in (0, -signal.SIGTERM):
                log.seek(0)
                tail = log.read()[-4000:].decode(errors="replace")
                print(f"server exited with {proc.returncode}:\n{tail}", file=sys.stderr)


async def wait_healthy(client: httpx.AsyncClient, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} while starting")
        with contextlib.suppress(httpx.HTTPError):
            if (await client.get("/health")).status_code == 200:
                return
        await anyio.sleep(0.2)
    raise RuntimeError(f"the server did not answer /health within {timeout_s} s")


def engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    kw = {"dtype": a.dtype, "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens,
          "kv_cache_bytes": None if a.kv_cache_gb is None else int(a.kv_cache_gb * 2**30)}
    return {k: v for k, v in kw.items() if v is not None}


def server_engine_flags(a: argparse.Namespace) -> list[tuple[str, Any]]:
    flags = [("--model", a.model)] + [(f"--{k.replace('_', '-')}", v) for k, v in engine_kwargs(a).items()]
    return [(f, v) for f, v in flags if v is not None]


async def deterministic_cost(a: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Two servers, `--no-deterministic` and `--deterministic` (the CPU default), in the same run on the same
    requests: saturated output tok/s (`--repeats` batches of `--saturation-requests` at once, the servers in
    turn, each batch new to both prefix caches) and single-stream decode (one request of 64 tokens at a time,
    the servers alternating: tok/s from the inter-token gaps, i.e. decode without the prefill)."""
    from agentrt.engine.loader import load_tokenizer, resolve_model

    prompts = Prompts(load_tokenizer(resolve_model(a.model)), (a.prompt_min, a.prompt_max),
                      (a.output_min, a.output_max), a.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    names = ("batch-variant", "deterministic")
    sat: dict[str, list[float]] = {n: [] for n in names}
    itl: dict[str, list[float]] = {n: [] for n in names}
    failed = dict.fromkeys(names, 0)
    base = argparse.Namespace(**{**vars(a), "extra_flags": ["--no-deterministic"]})
    det = argparse.Namespace(**{**vars(a), "extra_flags": ["--deterministic"]})
    with server_process(base) as (url0, p0), server_process(det) as (url1, p1):
        async with contextlib.AsyncExitStack() as stack:
            clients = {}
            for n, url, proc in ((names[0], url0, p0), (names[1], url1, p1)):
                clients[n] = await stack.enter_async_context(
                    httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits))
                await wait_healthy(clients[n], proc, a.startup_timeout_s)
            warm = prompts.draw("warm-up", 4, max_tokens=4)
            for n in names:
                await run_load(clients[n], warm, [0.0] * len(warm))
            for k in range(a.repeats):
                reqs = prompts.draw(f"saturation-{k}", a.saturation_requests)
                for n in (names if k % 2 == 0 else names[::-1]):
                    results, wall = await run_load(clients[n], reqs, [0.0] * len(reqs))
                    s = summarize(results, wall)
                    sat[n].append(s["output_tok_s"])
                    failed[n] += s["failed"]
                    print(f"saturation {k} {n}: {s['output_tok_s']:.1f} tok/s", file=sys.stderr)
            for i, req in enumerate(prompts.draw("single", a.ttft_requests, max_tokens=64)):
                for n in (names if i % 2 == 0 else names[::-1]):
                    r = await stream_chat(clients[n], req)
                    failed[n] += r.error is not None
                    itl[n] += r.itl_s
    res = {"saturated_tok_s": {n: statistics.median(v) for n, v in sat.items()},
           "single_decode_tok_s": {n: 1 / statistics.median(v) for n, v in itl.items()}, "failed": failed,
           "repeats": a.repeats, "requests": a.saturation_requests, "single_requests": a.ttft_requests}
    rows = []
    for key, label in (("saturated_tok_s", f"saturated output tok/s ({a.saturation_requests} requests at once, "
                                           f"median of {a.repeats})"),
                       ("single_decode_tok_s", f"single-stream decode tok/s (1 / median inter-token gap, "
                                               f"{a.ttft_requests} requests of 64 tokens)")):
        v = res[key]
        res[key.replace("_tok_s", "_cost")] = 1 - v["deterministic"] / v["batch-variant"]
        rows.append([label, v["batch-variant"], v["deterministic"], v["deterministic"] / v["batch-variant"]])
    table = markdown_table(["through agentrt serve", "--no-deterministic", "--deterministic",
                            "deterministic / batch-variant"], rows)
    cpu = cpu_info()
    section = (f"CPU: {cpu['model']}, {cpu['cores']} cores, SIMD flags: {' '.join(cpu['simd_flags']) or '-'}; "
               f"load average {os.getloadavg()[0]:.2f} at the end. Two `agentrt serve --db none` subprocesses, the "
               f"same engine options ({engine_kwargs(a) or 'defaults'}), one with `--no-deterministic`, one with "
               f"`--deterministic`; streaming chat, "
               f"greedy, ignore_eos, prompts {a.prompt_min}-{a.prompt_max} tokens, outputs "
               f"{a.output_min}-{a.output_max}; the servers take each batch and each single request in turn.\n\n"
               f"{table}\n\nCost of deterministic mode (1 - deterministic / batch-variant): saturated "
               f"**{res['saturated_cost']:+.0%}**, single-stream decode **{res['single_decode_cost']:+.0%}** "
               f"(target <= 10% each); failed requests: {failed}.\n")
    return res, section


# --- the in-process peers --------------------------------------------------------------------
def llm_generate_s(llm: Any, reqs: list[Req]) -> float:
    from agentrt.engine import SamplingParams

    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in reqs]
    t = time.perf_counter()
    outs = llm.generate([r.prompt_ids for r in reqs], params, progress=False)
    dt = time.perf_counter() - t
    assert [o.num_output_tokens for o in outs] == [r.max_tokens for r in reqs]
    return dt


async def engine_ttft_s(engine: Any, req: Req) -> float:
    """add_request -> the first delta with text (what the server can first send), then drain."""
    from agentrt.engine import SamplingParams

    params = SamplingParams(max_tokens=req.max_tokens, temperature=0, ignore_eos=True)
    first = None
    t = time.perf_counter()
    stream = engine.add_request(req.prompt_ids, params)
    async for d in stream:
        if first is None and d.new_text:
            first = time.perf_counter() - t
    await stream.result()
    assert first is not None, "no text in the output"
    return first


async def server_ttft_s(client: httpx.AsyncClient, req: Req) -> tuple[float, float]:
    """TTFT at the client, and inside the server (submit -> first token, from its /metrics)."""
    count0, sum0 = await server_ttft_metric(client)
    r = await stream_chat(client, req)
    if r.error is not None or r.ttft_s is None or r.prompt_tokens != len(req.prompt_ids):
        raise RuntimeError(f"low-load request failed: {r.error or 'no text, or other prompt token ids'}")
    for _ in range(100):  # the call is recorded once the server has closed it, just after [DONE]
        count, total = await server_ttft_metric(client)
        if count > count0:
            return r.ttft_s, total - sum0
        await anyio.sleep(0.01)
    raise RuntimeError("the server's /metrics did not record the low-load request")


async def server_ttft_metric(client: httpx.AsyncClient) -> tuple[float, float]:
    """(count, sum) of the server's time-to-first-token histogram."""
    values = {}
    for line in (await client.get("/metrics")).text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("agentrt:time_to_first_token_seconds_count", "agentrt:time_to_first_token_seconds_sum"):
            values[name.rsplit("_", 1)[1]] = float(value)
    return values["count"], values["sum"]


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- the run --------------------------------------------------------------------------------
async def measure_ttft(client: httpx.AsyncClient, engine: Any, reqs: list[Req]) -> dict[str, Any]:
    """Low load: each request alone, through the server and in-process; which goes first alternates."""
    pairs = []  # (server at the client, in-process, server's own submit -> first token) seconds
    for i, req in enumerate(reqs):
        if i % 2:
            local = await engine_ttft_s(engine, req)
            server, inside = await server_ttft_s(client, req)
        else:
            server, inside = await server_ttft_s(client, req)
            local = await engine_ttft_s(engine, req)
        pairs.append((server, local, inside))
    def med(xs: list[float]) -> float:
        return 1000 * statistics.median(xs)

    res = {"requests": len(pairs), "server_p50_ms": med([p[0] for p in pairs]),
           "inprocess_p50_ms": med([p[1] for p in pairs]), "paired_diff_p50_ms": med([p[0] - p[1] for p in pairs]),
           "server_inside_p50_ms": med([p[2] for p in pairs]), "frontend_p50_ms": med([p[0] - p[2] for p in pairs]),
           "pairs_ms": [[round(1000 * x, 2) for x in p] for p in pairs]}
    res["diff_ms"] = res["server_p50_ms"] - res["inprocess_p50_ms"]
    print(f"low load: server TTFT p50 {res['server_p50_ms']:.1f} ms, in-process {res['inprocess_p50_ms']:.1f} ms",
          file=sys.stderr)
    return res


async def measure_saturation(client: httpx.AsyncClient, pid: int, llm: Any, batches: list[list[Req]]) -> dict[str, Any]:
    """Each batch all at once through LLM.generate, then through the server; wall and CPU time."""
    pairs = []
    for k, reqs in enumerate(batches):
        cpu = time.process_time()
        t_llm = llm_generate_s(llm, reqs)
        llm_cpu, cpu, server_cpu = time.process_time() - cpu, time.process_time(), proc_cpu_s(pid)
        results, wall = await run_load(client, reqs, [0.0] * len(reqs))
        client_cpu, server_cpu = time.process_time() - cpu, proc_cpu_s(pid) - server_cpu
        s, out = summarize(results, wall), sum(q.max_tokens for q in reqs)
        pairs.append({"llm_s": t_llm, "llm_tok_s": out / t_llm, "llm_cpu_s": llm_cpu, "server_cpu_s": server_cpu,
                      "client_cpu_s": client_cpu, **s, "ratio": s["output_tok_s"] * t_llm / out,
                      "prompt_len_mismatches": sum(r.prompt_tokens != len(q.prompt_ids)
                                                   for r, q in zip(results, reqs) if r.error is None)})
        print(f"saturation {k}: LLM.generate {out / t_llm:.1f} tok/s, server {s['output_tok_s']:.1f} tok/s "
              f"({s['failed']} failed)", file=sys.stderr)
    out = sum(p["output_tokens"] for p in pairs)
    res = {"requests": len(batches[0]), "repeats": pairs,
           "server_tok_s": statistics.median(p["output_tok_s"] for p in pairs),
           "llm_tok_s": statistics.median(p["llm_tok_s"] for p in pairs),
           "server_request_throughput": statistics.median(p["request_throughput"] for p in pairs),
           # work per token, which the other tenants of a shared machine disturb less than wall time
           "llm_cpu_ms_per_token": 1000 * sum(p["llm_cpu_s"] for p in pairs) / out,
           "server_cpu_ms_per_token": 1000 * sum(p["server_cpu_s"] for p in pairs) / out,
           "client_cpu_ms_per_token": 1000 * sum(p["client_cpu_s"] for p in pairs) / out}
    res["ratio"] = statistics.median(p["ratio"] for p in pairs)  # each pair ran the same requests
    return res


async def measure_rates(client: httpx.AsyncClient, a: argparse.Namespace, prompts: Prompts,
                        saturated_req_s: float) -> list[dict[str, Any]]:
    rates = []
    for rate in a.rates:
        arrivals = poisson_arrivals(rate, a.duration_s, a.max_requests, a.seed)
        results, wall = await run_load(client, prompts.draw(f"rate-{rate}", len(arrivals)), arrivals)
        s = {"rate": rate, "load": rate / saturated_req_s, "sustainable": rate <= saturated_req_s,
             **summarize(results, wall)}
        rates.append(s)
        print(f"rate {rate}/s: {s['completed']}/{s['requests']} ok, {s['output_tok_s']:.1f} tok/s, "
              f"TTFT p50 {s['ttft_ms']['p50'] or 0:.0f} ms", file=sys.stderr)
    return rates


async def run(a: argparse.Namespace) -> dict[str, Any]:
    import agentrt.policies  # noqa: F401  (registers plas / atlas / mlfq with the engine)
    from agentrt.engine import LLM, AsyncEngine

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    with server_process(a) as (url, proc):  # loads while the in-process engines do
        kw = {**engine_kwargs(a), "policy": a.policy}
        llm = LLM(a.model, **kw)
        dtype = llm.core.config.dtype  # the server chooses it the same way
        prompts = Prompts(llm.tokenizer, (a.prompt_min, a.prompt_max), (a.output_min, a.output_max), a.seed)
        warm = prompts.draw("warm-up", 4, max_tokens=4)
        llm_generate_s(llm, warm)
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client, \
                AsyncEngine(model=a.model, **kw) as engine:
            await engine_ttft_s(engine, warm[0])
            await wait_healthy(client, proc, a.startup_timeout_s)
            await run_load(client, warm, [0.0] * len(warm))  # warm-up, not measured
            await stream_chat(client, warm[0])
            ttft = await measure_ttft(client, engine, prompts.draw("ttft", a.ttft_requests, a.ttft_max_tokens))
            batches = [prompts.draw(f"saturation-{k}", a.saturation_requests) for k in range(a.repeats)]
            saturation = await measure_saturation(client, proc.pid, llm, batches)
        del llm, engine  # the in-process engines' memory, before the load runs
        gc.collect()
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
            rates = await measure_rates(client, a, prompts, saturation["server_request_throughput"])
    targets = {
        "no_failures_at_sustainable_rates": all(r["failed"] == 0 for r in rates if r["sustainable"])
        and all(p["failed"] == 0 for p in saturation["repeats"]),
        "saturated_ratio_ge_0.90": saturation["ratio"] >= TARGET_RATIO,
        "low_load_ttft_within_10ms": ttft["paired_diff_p50_ms"] <= TARGET_TTFT_MS,
    }
    return {"model": a.model or "SmolLM2-135M-Instruct (default)", "policy": a.policy, "engine": engine_kwargs(a),
            "dtype": dtype, "code": code_version(),
            "workload": {"prompt_tokens": [a.prompt_min, a.prompt_max], "output_tokens": [a.output_min, a.output_max],
                         "ttft_max_tokens": a.ttft_max_tokens, "duration_s": a.duration_s,
                         "max_requests": a.max_requests, "seed": a.seed},
            "cpu": cpu_info(), "load_average": os.getloadavg(), "peers": {"ttft": ttft, "saturation": saturation},
            "rates": rates, "targets": targets}


def code_version() -> str:
    """HEAD's short hash, and how many files differ from it (others may be editing the tree)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], check=False, cwd=ROOT, capture_output=True, text=True).stdout.strip()

    with contextlib.suppress(OSError):
        dirty = len(git("status", "--porcelain", "--untracked-files=no").splitlines())
        return f"{git('rev-parse', '--short', 'HEAD') or 'unknown'}" + (f" + {dirty} modified files" if dirty else "")
    return "unknown"


def cpu_info() -> dict[str, Any]:
    """CPU model and the SIMD flags the kernels care about (Linux /proc/cpuinfo)."""
    model, flags = "unknown", []
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = [f for f in value.split() if f.startswith(("avx", "amx", "fma", "f16c", "sse4"))]
    return {"model": model, "cores": os.cpu_count(), "simd_flags": flags}


# --- reporting ------------------------------------------------------------------------------
def report(res: dict[str, Any], load_before: tuple[float, ...]) -> str:
    def f(v: float | None, spec: str = ".1f") -> str:
        return "-" if v is None else format(v, spec)

    ttft, sat, t, cpu, w = res["peers"]["ttft"], res["peers"]["saturation"], res["targets"], res["cpu"], res["workload"]
    yes = {True: "met", False: "**not met**"}
    peers = markdown_table(["comparison", "server", "in-process", "server vs in-process", "target", ""], [
        [f"saturated output tok/s ({sat['requests']} requests at once, medians of {len(sat['repeats'])})",
         f(sat["server_tok_s"]), f(sat["llm_tok_s"]) + " (LLM.generate)", f"{sat['ratio']:.2f}x per pair",
         f">= {TARGET_RATIO:.2f}x per pair", yes[t["saturated_ratio_ge_0.90"]]],
        ["saturated CPU ms per output token (server process; + client)",
         f"{sat['server_cpu_ms_per_token']:.1f}; +{sat['client_cpu_ms_per_token']:.1f}",
         f(sat["llm_cpu_ms_per_token"]), f(sat["llm_cpu_ms_per_token"] / sat["server_cpu_ms_per_token"], ".2f") + "x",
         "", ""],
        [f"low-load TTFT p50 ms ({ttft['requests']} requests, one at a time)", f(ttft["server_p50_ms"]),
         f(ttft["inprocess_p50_ms"]) + " (AsyncEngine)",
         f"{ttft['paired_diff_p50_ms']:+.1f} ms per prompt (medians {ttft['diff_ms']:+.1f} ms)",
         f"<= +{TARGET_TTFT_MS:.0f} ms per prompt", yes[t["low_load_ttft_within_10ms"]]],
    ])
    repeats = ", ".join(f"{p['ratio']:.2f}x" for p in sat["repeats"])
    rows = [[f"{r['rate']:g}", f"{r['load']:.2f}", r["requests"], r["failed"], f(r["request_throughput"], ".2f"),
             f(r["output_tok_s"]), f(r["ttft_ms"]["p50"], ".0f"), f(r["ttft_ms"]["p99"], ".0f"),
             f(r["itl_ms"]["p50"], ".0f"), f(r["itl_ms"]["p99"], ".0f"), f(r["e2e_s"]["p50"], ".2f"),
             f(r["e2e_s"]["p99"], ".2f")] for r in res["rates"]]
    table = markdown_table(["rate req/s", "load", "requests", "failed", "done req/s", "output tok/s", "TTFT p50 ms",
                            "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "E2E p50 s", "E2E p99 s"], rows) if rows else ""
    errors = {e: n for r in res["rates"] for e, n in r["errors"].items()}
    rates_note = (
        f"{table}\n\nload = rate / saturated server requests/s ({sat['server_request_throughput']:.2f}); done req/s "
        f"and output tok/s over first arrival -> last completion; TTFT = send -> first content chunk, ITL = gaps "
        f"between content chunks (pooled), E2E = send -> [DONE]. " if rows else ""
    )
    return (
        f"Run started {res['started']}. CPU: {cpu['model']}, {cpu['cores']} cores, SIMD flags: {' '.join(cpu['simd_flags']) or '-'}. "
        f"Load average (1 min) before / after: {load_before[0]:.2f} / {res['load_average'][0]:.2f} (a shared "
        f"machine: other work competes for the cores, hence the peers measured in the same run, interleaved).\n\n"
        f"Code {res['code']}. Model {res['model']}, {res['dtype']}, policy {res['policy']}, engine options "
        f"{res['engine'] or 'defaults'}; server: "
        f"`agentrt serve --db none` in a subprocess, client: httpx in this process (same cores). Streaming chat "
        f"calls, greedy, ignore_eos; prompts {w['prompt_tokens'][0]}-{w['prompt_tokens'][1]} tokens after the chat "
        f"template, outputs {w['output_tokens'][0]}-{w['output_tokens'][1]} tokens ({w['ttft_max_tokens']} at low "
        f"load), seed {w['seed']}; Poisson arrivals for {w['duration_s']:g} s per rate (at most "
        f"{w['max_requests']} requests).\n\n"
        f"{peers}\n\nSaturation pairs (server / LLM.generate, each pair on the same requests): {repeats}. "
        f"Low-load TTFT inside the server "
        f"(submit -> first token, its /metrics) p50 {ttft['server_inside_p50_ms']:.1f} ms, so HTTP, chat template "
        f"and SSE (client TTFT - inside) p50 {ttft['frontend_p50_ms']:.1f} ms.\n\n"
        f"{rates_note}Failed requests at sustainable rates (load <= 1) and at saturation: "
        f"{'none (target met)' if t['no_failures_at_sustainable_rates'] else 'some (target **not met**)'}"
        f"{'; errors: ' + json.dumps(errors) if errors else ''}.\n"
    )


def res_dtype(a: argparse.Namespace) -> Any:
    """The torch dtype the servers chose (`--dtype`, else the engine's auto choice on this machine)."""
    import torch

    from agentrt.engine import EngineConfig

    return getattr(torch, EngineConfig(dtype=a.dtype, device="cpu").dtype)


def parse_floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentrt bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--policy", default="plas", choices=["plas", "atlas", "mlfq", "fcfs"],
                    help="scheduling policy of the server and of the in-process peers (default: the server's)")
    ap.add_argument("--rates", type=parse_floats, default=[0.25, 0.5, 1.0, 1.5, 2.0],
                    help="requests/s, comma-separated ('' = only the peer comparisons)")
    ap.add_argument("--duration-s", type=float, default=30.0, help="Poisson arrivals per rate for this long")
    ap.add_argument("--max-requests", type=int, default=120, help="requests per rate at most")
    ap.add_argument("--saturation-requests", type=int, default=64, help="requests sent at once (vs LLM.generate)")
    ap.add_argument("--repeats", type=int, default=3, help="saturation pairs (server, LLM.generate)")
    ap.add_argument("--ttft-requests", type=int, default=20, help="low-load requests, one at a time, per system")
    ap.add_argument("--ttft-max-tokens", type=int, default=4, help="output tokens of the low-load requests")
    ap.add_argument("--prompt-min", type=int, default=32)
    ap.add_argument("--prompt-max", type=int, default=256)
    ap.add_argument("--output-min", type=int, default=16)
    ap.add_argument("--output-max", type=int, default=64)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--kv-cache-gb", type=float, default=None, help="engine KV cache size (default: the engine's)")
    ap.add_argument("--startup-timeout-s", type=float, default=300.0)
    ap.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                    help="the server exports its program and call spans there (agentrt serve's flag; an OTLP/HTTP "
                         "collector must listen); default: tracing off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deterministic-cost", action="store_true",
                    help="only a --deterministic server against a --no-deterministic one (saturation and "
                         "single-stream decode)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--docs", action=argparse.BooleanOptionalAction, default=False,
                    help="write this benchmark's section of docs/benchmarks/serve.md (default: no)")
    a = ap.parse_args(argv)
    if min(a.rates, default=1) <= 0 or a.repeats < 1 or a.ttft_requests < 1 or a.saturation_requests < 1:
        ap.error("--rates must be positive; --repeats, --ttft-requests, --saturation-requests at least 1")

    if a.deterministic_cost:
        res, section = anyio.run(deterministic_cost, a)
        print(json.dumps(res, indent=2) if a.json else section)
        if a.docs:
            from agentrt.bench.throughput import dtype_on_cpu

            write_section(f"Deterministic mode, serving ({dtype_on_cpu(res_dtype(a))})", section)
        return 0
    load_before = os.getloadavg()
    started = datetime.datetime.now(datetime.UTC).strftime("%H:%M UTC")
    res = anyio.run(run, a)
    res["started"] = started
    summary = report(res, load_before)
    print(json.dumps(res, indent=2) if a.json else summary)
    if a.docs:
        write_section("Serving", summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
