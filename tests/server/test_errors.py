"""Every way a request can go wrong gives an OpenAI-style error body with the right status (never a
traceback), and leaves the server serving with every KV block free: bad input, disconnects,
API keys and what they own, overload (429), and programs that end by idling."""

from __future__ import annotations

import time

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import assert_all_blocks_free
from tests.server.live import live_server, tiny_config

MAX_N = 4
MAX_BODY = 64 * 1024
MAX_TOKENS = 2000
HI = [{"role": "user", "content": "hi"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def assert_error(r: httpx.Response, status: int, param: str | None = "?", code: str | None = "?") -> dict:
    """`r` is an OpenAI-style error with `status`; `param` / `code` checked unless "?"."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert "Traceback" not in r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    if param != "?":
        assert err["param"] == param, err
    if code != "?":
        assert err["code"] == code, err
    return err


def idle_and_free(srv) -> None:
    srv.wait_idle(10)
    assert_all_blocks_free(srv.state.runtime.engine.core)


@pytest.fixture(scope="module")
def srv(tiny_model_path):
    config = tiny_config(tiny_model_path, served_model_name="tiny", max_n=MAX_N, max_body_bytes=MAX_BODY,
                         max_tokens_limit=MAX_TOKENS)
    with live_server(config) as s:
        yield s


# --- bad input --------------------------------------------------------------------------------
BAD_BODIES = [
    # (path, body, param)
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": HI, "max_tokens": "5"}, "max_tokens"),
    (CHAT, {"messages": HI, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": HI, "temperature": "hot"}, "temperature"),
    (CHAT, {"messages": HI, "temperature": 3.0}, "temperature"),
    (CHAT, {"messages": HI, "top_p": 0}, "top_p"),
    (CHAT, {"messages": HI, "n": 0}, "n"),
    (CHAT, {"messages": HI, "stream": "yes"}, "stream"),
    (CHAT, {"messages": HI, "seed": -1}, "seed"),
    (CHAT, {"messages": HI, "stop": 5}, "stop"),
    (CHAT, {"messages": HI, "logprobs": 1.5}, "logprobs"),
    (CHAT, {"messages": HI, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    (CHAT, {"messages": HI, "top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    (CHAT, {"messages": HI, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    (CHAT, {"messages": HI, "top_k": 0}, "top_k"),
    (CHAT, {"messages": HI, "stop_token_ids": [10**9]}, "stop_token_ids"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"messages": [{"content": "x"}]}, "messages[0].role"),
    (CHAT, {}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content"),
    (CHAT, {"messages": HI, "n": MAX_N + 1}, "n"),
    (CHAT, {"messages": HI, "max_tokens": MAX_TOKENS + 1}, "max_tokens"),
    (CHAT, {"messages": HI, "max_completion_tokens": MAX_TOKENS + 1}, "max_completion_tokens"),
    (CHAT, {"messages": HI, "stop": ""}, "stop"),
    (CHAT, {"messages": HI, "stop": ["x", ""]}, "stop"),
    (CHAT, {"messages": HI, "program_id": "bad id"}, "program_id"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
    (COMPLETIONS, {"prompt": "hi", "stop": ""}, "stop"),
    (COMPLETIONS, {"prompt": ["a", 1]}, "prompt"),
    (COMPLETIONS, {"prompt": [[1, 2], "a"]}, "prompt"),
    (COMPLETIONS, {"prompt": [1, [2]]}, "prompt"),
    (COMPLETIONS, {"prompt": {"text": "a"}}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": [[]]}, "prompt"),
    (COMPLETIONS, {"prompt": [-1]}, "prompt"),
    (COMPLETIONS, {"prompt": [10**12]}, "prompt"),
    (COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 2}, "n"),  # 6 completions > --max-n
    (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"max_tokens": 3}, "prompt"),
]


@pytest.mark.parametrize("path,body,param", BAD_BODIES, ids=[f"{i}-{p[1]}" for i, p in enumerate(BAD_BODIES)])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_field_is_a_400_naming_it(http, path, body, param, stream):
    err = assert_error(http.post(path, json={**body, "stream": stream} if "stream" not in body else body), 400, param)
    assert err["type"] == "invalid_request_error"


OVER_LIMITS = [  # (path, body, param, the flag that sets the limit)
    (CHAT, {"messages": HI, "max_tokens": MAX_TOKENS + 1}, "max_tokens", "--max-tokens-limit"),
    (CHAT, {"messages": HI, "max_completion_tokens": MAX_TOKENS + 1}, "max_completion_tokens", "--max-tokens-limit"),
    (CHAT, {"messages": HI, "n": MAX_N + 1}, "n", "--max-n"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": MAX_TOKENS + 1}, "max_tokens", "--max-tokens-limit"),
    (COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 2}, "n", "--max-n"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": MAX_TOKENS + 1}, "max_output_tokens", "--max-tokens-limit"),
]


@pytest.mark.parametrize("path,body,param,flag", OVER_LIMITS, ids=[f"{p[0]}-{p[2]}" for p in OVER_LIMITS])
def test_over_a_limit_names_the_flag_that_sets_it(http, path, body, param, flag):
    err = assert_error(http.post(path, json={"model": "tiny", **body}), 400, param)
    assert flag in err["message"] and str(body[param] if param in body else MAX_N) in err["message"], err


def test_anthropic_max_tokens_over_the_limit_names_the_flag(http):
    r = http.post("/v1/messages", json={"model": "tiny", "messages": HI, "max_tokens": MAX_TOKENS + 1})
    assert r.status_code == 400 and "--max-tokens-limit" in r.text and str(MAX_TOKENS + 1) in r.text, r.text


def test_without_a_max_tokens_limit_the_context_is_the_limit():
    from types import SimpleNamespace

    from agentrt.server.calls import max_tokens_flag

    def state(limit):
        return SimpleNamespace(config=SimpleNamespace(max_tokens_limit=limit), max_model_len=2048)

    assert max_tokens_flag(state(None)) == max_tokens_flag(state(4096)) == "the context, --max-model-len"
    assert max_tokens_flag(state(2048)) == max_tokens_flag(state(16)) == "--max-tokens-limit"


@pytest.mark.parametrize("path,body", [
    (CHAT, {"messages": HI, "max_tokens": 1}),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 1}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
    ("/v1/messages", {"messages": HI, "max_tokens": 1}),
    ("/v1/embeddings", {"input": "hi"}),
])
def test_unknown_body_fields_are_ignored_and_logged_once(http, path, body, caplog):
    """As vLLM: a field the API does not define is ignored (clients send their own), its name logged once."""
    field = f"no_such_field_{path.rsplit('/', 1)[-1]}"
    with caplog.at_level("WARNING", logger="agentrt.server"):
        for _ in range(2):
            r = http.post(path, json={"model": "tiny", **body, field: 1, "misspelt_temprature": 0.5})
            assert r.status_code == 200, r.text
            if "x-program-id" in r.headers:  # a response's chain goes on, its KV pinned: end it
                http.delete(f"/v1/programs/{r.headers['x-program-id']}")
    logged = [rec.getMessage() for rec in caplog.records if field in rec.getMessage()]
    assert len(logged) == 1 and "ignored" in logged[0] and "misspelt_temprature" in logged[0], logged


@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]", b'{"messages": [', b"\xff\xfe"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_malformed_json_is_a_400(http, path, body):
    assert_error(http.post(path, content=body, headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize("path,body,param", [
    (COMPLETIONS, {"prompt": [1] * 2100, "max_tokens": 4}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "hello " * 2100}]}, "messages"),
])
def test_prompt_longer_than_the_context(http, srv, path, body, param):
    err = assert_error(http.post(path, json=body), 400, param)
    assert f"context of {srv.state.max_model_len} tokens" in err["message"]


@pytest.mark.parametrize("path,body", [(CHAT, {"messages": HI}), (COMPLETIONS, {"prompt": "hi"})])
def test_unknown_model_is_a_404(http, path, body):
    err = assert_error(http.post(path, json={**body, "model": "gpt-9"}), 404, "model", "model_not_found")
    assert "gpt-9" in err["message"] and "tiny" in err["message"]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/v1/programs"])
def test_body_over_the_limit_is_a_413(http, path):
    body = {"messages": [{"role": "user", "content": "x" * MAX_BODY}], "prompt": "x" * MAX_BODY}
    assert_error(http.post(path, json=body), 413, None, "body_too_large")


def test_body_over_the_limit_without_content_length_is_a_413(http):
    def chunks():  # chunked transfer: no content-length to check up front
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    assert_error(http.post(COMPLETIONS, content=chunks()), 413, None, "body_too_large")


@pytest.mark.parametrize("headers,body,param", [
    ({"X-Program-Id": "bad id"}, {}, "program_id"),
    ({"X-Program-Id": "-leading-dash"}, {}, "program_id"),
    ({"X-Program-Id": "x" * 129}, {}, "program_id"),
    ({"X-Thread-Id": "a/b"}, {}, "thread_id"),
    ({"X-Program-Id": "p-a"}, {"program_id": "p-b"}, "program_id"),
    ({"X-Thread-Id": "t-a"}, {"thread_id": "t-b"}, "thread_id"),
])
@pytest.mark.parametrize("path,base", [(CHAT, {"messages": HI}), (COMPLETIONS, {"prompt": "hi"})])
def test_bad_program_keys(http, path, base, headers, body, param):
    assert_error(http.post(path, json={**base, **body, "max_tokens": 2}, headers=headers), 400, param)


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_unknown_program_is_a_404(http, method):
    err = assert_error(http.request(method, "/v1/programs/no-such-program"), 404, "program_id", "program_not_found")
    assert "no-such-program" in err["message"]


def test_programs_endpoint_errors(http):
    assert http.post("/v1/programs", json={"program_id": "err-running"}).status_code == 201
    assert_error(http.post("/v1/programs", json={"program_id": "err-running"}), 409, "program_id", "program_exists")
    assert_error(http.post("/v1/programs", json={"program_id": "bad id"}), 400, "program_id")
    assert_error(http.post("/v1/programs", json=[1]), 400)
    assert_error(http.get("/v1/programs", params={"limit": "abc"}), 400, "limit")
    assert_error(http.get("/v1/programs", params={"limit": 0}), 400, "limit")
    assert http.delete("/v1/programs/err-running").json()["state"] == "finished"
    assert http.post("/v1/programs", json={"program_id": "err-running"}).status_code == 201  # ended: may start again
    http.delete("/v1/programs/err-running")


def test_errors_leave_the_server_serving(http, srv):
    """Run last of the bad-input tests (by file order): every rejected call released what it took."""
    r = http.post(CHAT, json={"messages": HI, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    idle_and_free(srv)
    assert srv.state.runtime.num_waiting_calls() == 0
    assert not srv.state.runtime.program_manager.inflight


def test_call_larger_than_the_kv_cache_is_a_400(tiny_model_path):
    """A call whose prompt and max_tokens could never fit the KV cache, even alone, is refused before the engine
    (vLLM answers 400 too), naming max_tokens; the server goes on serving, every block free."""
    with live_server(tiny_config(tiny_model_path, engine={"num_blocks": 8})) as small:  # 128 tokens of KV
        with httpx.Client(base_url=small.url, timeout=60) as client:
            for path, body in ((COMPLETIONS, {"prompt": [5] * 100, "max_tokens": 100}),
                               (CHAT, {"messages": [{"role": "user", "content": "hello " * 60}], "max_tokens": 200})):
                err = assert_error(client.post(path, json=body), 400, "max_tokens")
                assert "KV blocks" in err["message"] and f"max_tokens={body['max_tokens']}" in err["message"]
            r = client.post(COMPLETIONS, json={"prompt": [5] * 20, "max_tokens": 8, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        idle_and_free(small)


# --- a client that goes away aborts its call ----------------------------------------------------
LONG = {"messages": HI, "max_tokens": MAX_TOKENS, "ignore_eos": True}


def test_stream_disconnect_aborts(srv):
    pid = "disc-stream"
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        with c.stream("POST", CHAT, json={**LONG, "stream": True}, headers={"X-Program-Id": pid}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]  # two events, each followed by a blank line
            assert got[0].startswith("data: ")
    t0 = time.monotonic()
    idle_and_free(srv)
    assert time.monotonic() - t0 < 5
    info = srv.state.runtime.programs[pid]
    assert info.calls_done == 1 and info.calls_active == 0
    assert 0 < info.num_output_tokens < MAX_TOKENS


def test_non_stream_timeout_aborts(srv):
    pid = "disc-plain"
    with httpx.Client(base_url=srv.url, timeout=0.5) as c:
        with pytest.raises(httpx.TimeoutException):
            c.post(CHAT, json=LONG, headers={"X-Program-Id": pid})
    t0 = time.monotonic()
    idle_and_free(srv)
    assert time.monotonic() - t0 < 5
    info = srv.state.runtime.programs[pid]
    assert info.calls_done == 1 and info.num_output_tokens < MAX_TOKENS


def test_non_stream_cancelled_client_aborts(srv):
    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            with anyio.move_on_after(0.5):
                await c.post(CHAT, json=LONG, headers={"X-Program-Id": "disc-cancel"})
                raise AssertionError("2000 tokens in 0.5 s")

    anyio.run(main)
    idle_and_free(srv)
    info = srv.state.runtime.programs["disc-cancel"]
    assert info.calls_done == 1 and info.num_output_tokens < MAX_TOKENS


# --- API keys: authentication, ownership, no shared cache ---------------------------------------
@pytest.fixture(scope="module")
def keyed(tiny_model_path):
    with live_server(tiny_config(tiny_model_path, served_model_name="tiny", api_keys=["k1", "k2"])) as s:
        yield s


def as_key(srv, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=srv.url, headers=headers, timeout=60)


ENDPOINTS = [
    ("GET", "/v1/models", None), ("GET", "/metrics", None), ("GET", "/openapi.json", None),
    ("POST", CHAT, {"messages": HI, "max_tokens": 1}), ("POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/programs", {}), ("GET", "/v1/programs", None), ("GET", "/v1/programs/p", None),
    ("DELETE", "/v1/programs/p", None), ("GET", "/v1/models/tiny", None), ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1]}), ("GET", "/v1/responses/resp-x", None),
    ("POST", "/reset_prefix_cache", None),
]


@pytest.mark.parametrize("auth", [None, "Bearer k3", "Bearer k1x", "Basic k1", "Bearer"])
@pytest.mark.parametrize("method,path,body", ENDPOINTS, ids=[f"{m} {p}" for m, p, _ in ENDPOINTS])
def test_missing_or_wrong_key_is_a_401(keyed, auth, method, path, body):
    headers = {"Authorization": auth} if auth else {}
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        r = c.request(method, path, json=body, headers=headers)
    err = assert_error(r, 401, None, "invalid_api_key")
    assert err["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer"


def test_health_needs_no_key(keyed):
    with as_key(keyed, None) as c:
        assert c.get("/health").json() == {"status": "ok"}
    with as_key(keyed, "k2") as c:
        assert c.get("/v1/models").status_code == 200


def test_programs_belong_to_their_key(keyed):
    with as_key(keyed, "k1") as k1, as_key(keyed, "k2") as k2:
        assert k1.post("/v1/programs", json={"program_id": "p"}).status_code == 201
        assert k1.post(CHAT, json={"messages": HI, "max_tokens": 2}, headers={"X-Program-Id": "p"}).status_code == 200
        assert k1.post(CHAT, json={"messages": HI, "max_tokens": 2, "program_id": "p-by-call"}).status_code == 200

        for pid in ("p", "p-by-call"):
            assert_error(k2.get(f"/v1/programs/{pid}"), 404, "program_id", "program_not_found")
            assert_error(k2.delete(f"/v1/programs/{pid}"), 404, "program_id", "program_not_found")
            assert_error(k2.post(CHAT, json={"messages": HI, "max_tokens": 2}, headers={"X-Program-Id": pid}),
                         404, "program_id", "program_not_found")
            assert_error(k2.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2, "program_id": pid}),
                         404, "program_id", "program_not_found")
            r = k2.post("/v1/programs", json={"program_id": pid})  # refused; 409 does tell k2 the id is taken
            assert_error(r, r.status_code if r.status_code in (404, 409) else 404, "program_id")
        assert {"p", "p-by-call"}.isdisjoint(q["id"] for q in k2.get("/v1/programs").json()["data"])
        assert {"p", "p-by-call"} <= {q["id"] for q in k1.get("/v1/programs").json()["data"]}

        p = k1.get("/v1/programs/p").json()
        assert (p["state"], p["calls_done"]) == ("running", 1)  # k2's attempts touched nothing
        assert k1.delete("/v1/programs/p").json()["state"] == "finished"
        assert k1.delete("/v1/programs/p-by-call").json()["state"] == "finished"
        assert_error(k2.get("/v1/programs/p"), 404)
    idle_and_free(keyed)


def test_stored_responses_belong_to_their_key(keyed):
    with as_key(keyed, "k1") as k1, as_key(keyed, "k2") as k2:
        r = k1.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})
        assert r.status_code == 200
        rid = r.json()["id"]
        assert k1.get(f"/v1/responses/{rid}").json() == r.json()
        assert_error(k2.get(f"/v1/responses/{rid}"), 404, "response_id", "response_not_found")
        unstored = k1.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "store": False}).json()
        assert_error(k1.get(f"/v1/responses/{unstored['id']}"), 404, "response_id", "response_not_found")
        assert_error(k2.delete(f"/v1/responses/{rid}"), 404, "response_id", "response_not_found")
        assert_error(k2.get(f"/v1/responses/{rid}/input_items"), 404, "response_id", "response_not_found")
        assert k1.get(f"/v1/responses/{rid}/input_items").json()["data"][0]["content"][0]["text"] == "hi"
        assert k1.get(f"/v1/responses/{rid}").status_code == 200  # k2's attempt deleted nothing
        assert k1.delete(f"/v1/responses/{rid}").json() == {"id": rid, "object": "response", "deleted": True}
        assert_error(k1.get(f"/v1/responses/{rid}"), 404, "response_id", "response_not_found")
        assert_error(k1.delete(f"/v1/responses/{rid}"), 404, "response_id", "response_not_found")
        assert_error(k1.post("/v1/responses", json={"input": "and?", "max_output_tokens": 2,
                                                    "previous_response_id": rid}),
                     404, "previous_response_id", "response_not_found")
        for pid in (r.json()["program_id"], unstored["program_id"]):  # a chain stays open for its next response
            assert k1.delete(f"/v1/programs/{pid}").json()["state"] == "finished"
    idle_and_free(keyed)


def prefix_hits_metric(client: httpx.Client) -> float:
    families = text_string_to_metric_families(client.get("/metrics").text)
    return next(s.value for f in families for s in f.samples if s.name == "agentrt:prefix_cache_hits_total")


def test_keys_share_no_cached_blocks(keyed):
    prompt = list(range(1000, 1070))  # 70 tokens: 4 full blocks of 16
    kv = keyed.state.runtime.engine.kv_stats

    def send(c: httpx.Client) -> int:
        before = kv().prefix_hit_tokens
        assert c.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 1}).status_code == 200
        keyed.wait_idle()
        return kv().prefix_hit_tokens - before

    with as_key(keyed, "k1") as k1, as_key(keyed, "k2") as k2:
        assert send(k1) == 0
        assert send(k2) == 0  # k1's blocks are in the cache, but salted with k1's key
        assert send(k1) >= 32
        assert send(k2) >= 32  # k2's own blocks, from its first call
        assert prefix_hits_metric(k2) == kv().prefix_hit_tokens  # /metrics reports the engine's count
    idle_and_free(keyed)


# --- overload: 429 ------------------------------------------------------------------------------
def test_overload_is_a_429_and_accepted_calls_finish(tiny_model_path):
    config = tiny_config(tiny_model_path, served_model_name="tiny", max_waiting=2, engine={"max_num_seqs": 1})
    body = {"messages": HI, "max_tokens": 24, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with live_server(config) as s:
        results: list[tuple[int, dict | None, list[str], httpx.Headers]] = []

        async def one(c: httpx.AsyncClient) -> None:
            async with c.stream("POST", CHAT, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    results.append((r.status_code, r.json(), [], r.headers))
                    return
                events = [line async for line in r.aiter_lines() if line]
                results.append((200, None, events, r.headers))

        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c, anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(one, c)

        anyio.run(main)
        statuses = sorted(st for st, *_ in results)
        assert statuses.count(429) >= 1 and statuses.count(200) >= 1 and set(statuses) == {200, 429}, statuses
        for status, err, events, headers in results:
            if status == 429:
                assert headers["retry-after"] == "1"
                assert err["error"]["type"] == "rate_limit_error" and err["error"]["code"] == "overloaded"
                assert set(err["error"]) == {"message", "type", "param", "code"}
            else:
                assert events[-1] == "data: [DONE]"
                assert '"completion_tokens":24' in events[-2]
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.post(CHAT, json={"messages": HI, "max_tokens": 2}).status_code == 200
        idle_and_free(s)
        assert s.state.runtime.num_waiting_calls() == 0


# --- programs end by themselves when idle --------------------------------------------------------
def test_idle_program_ends_by_itself(tiny_model_path):
    config = tiny_config(tiny_model_path, served_model_name="tiny", program_idle_timeout_s=1)
    with live_server(config) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        assert c.post(CHAT, json={"messages": HI, "max_tokens": 2}, headers={"X-Program-Id": "idler"}).status_code == 200
        assert c.get("/v1/programs/idler").json()["state"] == "running"
        t0 = time.monotonic()
        while (p := c.get("/v1/programs/idler").json())["state"] == "running":
            assert time.monotonic() - t0 < 3, p
            time.sleep(0.1)
        assert (p["state"], p["calls_done"]) == ("finished", 1)
        idle_and_free(s)
