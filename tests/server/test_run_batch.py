"""`agentrt run-batch`: an OpenAI Batch API file through the server app in-process. Lines of every kind
in one file come back in input order with their custom_id and exactly the body the same request gets
over HTTP from a live server on the same model; bad lines get an error naming the problem without
stopping the others; stdin to stdout through the `agentrt` command; an unreadable input exits 2."""

from __future__ import annotations

import io
import json
import sys
import time

import anyio
import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentrt.command import main as cli
from agentrt.run_batch import in_process_client, run_batch
from agentrt.server import create_app
from tests.conftest import assert_all_blocks_free
from tests.server.live import tiny_config
from tests.test_cli import one_line_error

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 12,
        "temperature": 0}
COMPLETION = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1, "temperature": 0}
EMBEDDING = {"model": "tiny", "input": ["The quick brown fox", "jumps"]}
BAD_BODY = {"model": "tiny", "prompt": "x", "max_tokens": -1}  # the server's 400, not the batch's


def line(custom_id, url, body, method="POST") -> bytes:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body}).encode() + b"\n"


def without_ids(body: dict) -> dict:
    """A response body less what differs between two runs of one request (ids, time, prefix-cache hits)."""
    out = {k: v for k, v in body.items() if k not in ("id", "created", "program_id")}
    if "usage" in out:
        out["usage"] = {k: v for k, v in out["usage"].items() if k != "prompt_tokens_details"}
    return out


async def from_list(items: list[bytes]):
    for x in items:
        yield x


def run_in_process(app, lines: list[bytes], max_concurrency: int) -> tuple[list[dict], object]:
    """Run `lines` through `app`; then, with the app still up, check every KV block is free."""
    out: list[bytes] = []

    async def write(data: bytes) -> None:
        out.append(data)

    async def main():
        async with in_process_client(app) as client:
            summary = await run_batch(client, from_list(lines), write, max_concurrency=max_concurrency)
            core = app.state.server.runtime.engine.core
            deadline = time.monotonic() + 30
            while core.scheduler.has_work() or core.requests:
                assert time.monotonic() < deadline, list(core.requests)
                await anyio.sleep(0.02)
            assert_all_blocks_free(core)
            assert not any(core.num_tracked().values()), core.num_tracked()
            return summary

    summary = anyio.run(main)
    return [json.loads(x) for x in b"".join(out).splitlines()], summary


def test_lines_in_order_as_over_http(tiny_model_path, http):
    lines = [
        line("chat", "/v1/chat/completions", CHAT),  # 12 tokens: finishes after the next line
        line("completion", "/v1/completions", COMPLETION),
        b"\n",  # blank: skipped, no output line
        b"{not json\n",
        line("embedding", "/v1/embeddings", EMBEDDING),
        json.dumps({"method": "POST", "url": "/v1/completions", "body": COMPLETION}).encode(),
        line("chat", "/v1/completions", COMPLETION),  # custom_id taken
        line("get", "/v1/models", {}, method="GET"),
        line("files", "/v1/files", {}),
        line("stream", "/v1/completions", {**COMPLETION, "stream": True}),
        json.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/completions"}).encode(),
        line("bad-body", "/v1/completions", BAD_BODY),
        line("score", "/v1/score", {"model": "tiny", "text_1": "fox", "text_2": ["dog", "cat"]}),
    ]
    app = create_app(tiny_config(tiny_model_path, served_model_name="tiny"))
    records, summary = run_in_process(app, lines, max_concurrency=2)

    assert [r["custom_id"] for r in records] == ["chat", "completion", None, "embedding", None, "chat", "get",
                                                 "files", "stream", "no-body", "bad-body", "score"]
    assert (summary.lines, summary.ok, summary.failed, summary.invalid) == (12, 4, 1, 7)
    assert len({r["id"] for r in records}) == 12 and all(r["id"].startswith("batch_req_") for r in records)
    by_id = {r["custom_id"]: r for r in records if r["error"] is None}

    # answered lines: the body the live server gives the same request, ids and times apart
    for cid, url, body in (("chat", "/v1/chat/completions", CHAT), ("completion", "/v1/completions", COMPLETION),
                           ("bad-body", "/v1/completions", BAD_BODY)):
        want = http.post(url, json=body)
        got = by_id[cid]["response"]
        assert got["status_code"] == want.status_code and got["request_id"].startswith("req_")
        assert without_ids(got["body"]) == without_ids(want.json()), cid
    assert by_id["chat"]["response"]["body"]["choices"][0]["message"]["content"]
    assert by_id["bad-body"]["response"]["body"]["error"]["param"] == "max_tokens"
    want = http.post("/v1/embeddings", json=EMBEDDING).json()
    got = by_id["embedding"]["response"]["body"]
    assert without_ids({**got, "data": None}) == without_ids({**want, "data": None})
    for g, w in zip(got["data"], want["data"], strict=True):
        np.testing.assert_allclose(g["embedding"], w["embedding"], rtol=1e-4, atol=1e-5)
    assert [d["index"] for d in by_id["score"]["response"]["body"]["data"]] == [0, 1]

    # lines that are no request: an error object naming the line and the problem, no response
    errors = {i: (r["error"]["code"], r["error"]["message"]) for i, r in enumerate(records) if r["error"]}
    assert all(records[i]["response"] is None for i in errors)
    assert {i: code for i, (code, _) in errors.items()} == {
        2: "invalid_json", 4: "missing_custom_id", 5: "duplicate_custom_id", 6: "invalid_method", 7: "invalid_url",
        8: "stream_not_supported", 9: "missing_body"}
    assert errors[2][1].startswith("line 4: not JSON")
    assert errors[5][1] == "line 7: custom_id 'chat' was used by an earlier line"
    assert "'GET'" in errors[6][1] and "'/v1/files'" in errors[7][1] and "/v1/chat/completions" in errors[7][1]


def test_order_and_concurrency_bound_without_a_model():
    """Later lines finish first; the output keeps the input's order and no more than 3 are in flight."""
    in_flight, peak = 0, 0

    async def slow(request: Request) -> JSONResponse:
        nonlocal in_flight, peak
        body = await request.json()
        in_flight += 1
        peak = max(peak, in_flight)
        await anyio.sleep(body["sleep"])
        in_flight -= 1
        return JSONResponse({"n": body["n"]})

    app = Starlette(routes=[Route("/v1/completions", slow, methods=["POST"])])
    lines = [line(f"c{n}", "/v1/completions", {"n": n, "sleep": 0.01 * (10 - n)}) for n in range(10)]
    out: list[bytes] = []

    async def write(data: bytes) -> None:
        out.append(data)

    async def main():
        async with in_process_client(app) as client:
            return await run_batch(client, from_list(lines), write, max_concurrency=3)

    summary = anyio.run(main)
    records = [json.loads(x) for x in b"".join(out).splitlines()]
    assert [r["response"]["body"]["n"] for r in records] == list(range(10))
    assert [r["custom_id"] for r in records] == [f"c{n}" for n in range(10)]
    assert peak == 3 and summary.ok == 10


def test_stdin_to_stdout_through_the_command(tiny_model_path, monkeypatch, capsys):
    data = line("a", "/v1/completions", COMPLETION) + b"oops\n" + line("b", "/v1/chat/completions", CHAT)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert cli(["run-batch", "-i", "-", "-o", "-", "--model", str(tiny_model_path), "--served-model-name", "tiny",
                "--num-blocks", "256", "--max-num-seqs", "4"]) == 0
    out, err = capsys.readouterr()
    records = [json.loads(x) for x in out.splitlines()]  # stdout holds the records alone
    assert [r["custom_id"] for r in records] == ["a", None, "b"]
    assert records[0]["response"]["body"]["object"] == "text_completion"
    assert records[1]["error"]["code"] == "invalid_json"
    assert records[2]["response"]["body"]["object"] == "chat.completion"
    assert "3 lines: 2 ok, 0 failed, 1 invalid" in err


@pytest.mark.parametrize("args, needles", [
    (["-i", "{tmp}/missing.jsonl", "-o", "{tmp}/out.jsonl"], ["cannot open the input file", "missing.jsonl",
                                                              "No such file"]),
    (["-i", "{tmp}", "-o", "{tmp}/out.jsonl"], ["cannot read the input file", "it is a directory"]),
    (["-i", "-", "-o", "{tmp}/nodir/out.jsonl"], ["cannot write the output file", "no such directory"]),
    (["-i", "{tmp}/in.jsonl", "-o", "{tmp}/in.jsonl"], ["is the input file"]),
    (["-i", "-", "-o", "-", "--max-concurrency", "0"], ["--max-concurrency", "0"]),
])
def test_bad_files_fail_before_the_model_loads(args, needles, tmp_path, monkeypatch, capsys):
    import agentrt.server

    monkeypatch.setattr(agentrt.server, "create_app", lambda *a, **k: pytest.fail("the app was built"))
    (tmp_path / "in.jsonl").write_bytes(line("a", "/v1/completions", COMPLETION))
    assert cli(["run-batch", *(a.format(tmp=tmp_path) for a in args)]) == 2
    one_line_error(capsys, *needles)
    assert not (tmp_path / "out.jsonl").exists()
