"""The OpenAI-compatible API through the official `openai` client against a live server on loopback:
chat and completions (streaming and not), usage, n, stop, seed, logprobs, program ids, and the same
greedy outputs as the in-process engine and runtime."""

from __future__ import annotations

import asyncio

import anyio
import openai
import pytest

import agentrt
from agentrt.engine import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free
from tests.server.live import live_server, tiny_config

HAS_TOP_LOGPROBS = "top_logprobs" in getattr(SamplingParams, "__dataclass_fields__", {})
needs_top_logprobs = pytest.mark.skipif(not HAS_TOP_LOGPROBS, reason="engine has no SamplingParams.top_logprobs yet")

HELLO = [{"role": "user", "content": "Hello, who are you?"}]
NUM_BLOCKS = 256


@pytest.fixture(scope="module")
def srv(tiny_model_path):
    with live_server(tiny_config(tiny_model_path, served_model_name="tiny", engine={"num_blocks": NUM_BLOCKS})) as s:
        yield s
        s.wait_idle()
        assert_all_blocks_free(s.state.runtime.engine.core)


def chat_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def greedy_chat(client, messages=HELLO, **kw):
    kw = {"max_tokens": 12, "temperature": 0, **kw}
    return client.chat.completions.create(model="tiny", messages=messages, **kw)


# --- basics ---------------------------------------------------------------------------------
def test_models_list(client, srv):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].model_extra["max_model_len"] == srv.state.max_model_len


def test_chat_usage_counts_tokens(client, tok):
    r = greedy_chat(client, extra_body={"ignore_eos": True}, max_tokens=7)
    (choice,) = r.choices
    assert r.object == "chat.completion" and choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(chat_ids(tok, HELLO))
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_completion_usage_counts_tokens(client, tok):
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tok("Once upon a time")["input_ids"])
    assert (r.usage.completion_tokens, r.usage.total_tokens) == (5, r.usage.prompt_tokens + 5)


def test_chat_stream_matches_non_stream(client):
    full = greedy_chat(client)
    chunks = list(greedy_chat(client, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.usage is None for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [full.choices[0].finish_reason]


def test_completion_stream_matches_non_stream(client):
    kw = dict(model="tiny", prompt="The weather today", max_tokens=10, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_stream_include_usage_gives_a_final_usage_chunk(client, tok, kind):
    opts = dict(stream=True, stream_options={"include_usage": True}, max_tokens=4, temperature=0,
                extra_body={"ignore_eos": True})
    if kind == "chat":
        chunks = list(client.chat.completions.create(model="tiny", messages=HELLO, **opts))
        prompt_tokens = len(chat_ids(tok, HELLO))
    else:
        chunks = list(client.completions.create(model="tiny", prompt="Hi there", **opts))
        prompt_tokens = len(tok("Hi there")["input_ids"])
    last = chunks[-1]
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        prompt_tokens, 4, prompt_tokens + 4)
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_raw_stream_ends_with_done(http, path):
    body = {"messages": HELLO} if "chat" in path else {"prompt": "Hi"}
    with http.stream("POST", path, json={**body, "stream": True, "max_tokens": 3}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-program-id"]
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1]) and len(events) >= 3


def test_max_completion_tokens_wins_over_max_tokens(client):
    r = greedy_chat(client, max_tokens=10, max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_content_as_text_parts(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "who are you?"}]}]
    a, b = greedy_chat(client, parts), greedy_chat(client)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


# --- n, stop, seed, logprobs ----------------------------------------------------------------
def test_chat_n3(client, tok):
    r = greedy_chat(client, n=3, max_tokens=4, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == len(chat_ids(tok, HELLO))  # the prompt counts once
    assert r.usage.completion_tokens == 12


def test_chat_n3_stream_indices(client):
    chunks = list(greedy_chat(client, n=3, max_tokens=5, temperature=1.0, seed=5, stream=True,
                              extra_body={"ignore_eos": True}))
    texts, finishes = {}, {}
    for c in chunks:
        (choice,) = c.choices
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        if choice.finish_reason:
            assert choice.index not in finishes
            finishes[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1, 2] and finishes == {0: "length", 1: "length", 2: "length"}
    full = greedy_chat(client, n=3, max_tokens=5, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert [texts[i] for i in range(3)] == [c.message.content for c in full.choices]


def test_completions_n3_and_several_prompts(client):
    r = client.completions.create(model="tiny", prompt="One two", n=3, max_tokens=3, seed=1)
    assert [c.index for c in r.choices] == [0, 1, 2]
    r = client.completions.create(model="tiny", prompt=["One two", "Three four"], n=2, max_tokens=3, seed=1)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    chunks = list(client.completions.create(model="tiny", prompt="One two", n=3, max_tokens=3, seed=1, stream=True))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1, 2}


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_output(client, stream):
    full = greedy_chat(client, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].message.content
    mid = len(full) // 2
    stop = full[mid : mid + 3]
    assert stop.strip(), full
    expected = full[: full.find(stop)]
    r = greedy_chat(client, max_tokens=24, stop=[stop], stream=stream, extra_body={"ignore_eos": True})
    if stream:
        chunks = list(r)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    assert (text, reason) == (expected, "stop")


def test_completion_stop_string(client):
    kw = dict(model="tiny", prompt="Numbers:", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), full
    r = client.completions.create(stop=stop, **kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (full[: full.find(stop)], "stop")


def test_seed_makes_sampling_repeatable(client):
    def sample(seed):
        return greedy_chat(client, temperature=1.0, seed=seed, max_tokens=8).choices[0].message.content

    assert sample(11) == sample(11)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


@needs_top_logprobs
def test_chat_logprobs(client):
    r = greedy_chat(client, logprobs=True, top_logprobs=2, max_tokens=6, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes) == t.token.encode()
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert (t.top_logprobs[0].token, t.top_logprobs[0].logprob) == pytest.approx((t.token, t.logprob))  # greedy

    chunks = list(greedy_chat(client, logprobs=True, top_logprobs=2, max_tokens=6, stream=True,
                              extra_body={"ignore_eos": True}))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, len(t.top_logprobs)) for t in streamed] == [(t.token, 2) for t in content]


def test_chat_logprobs_without_top(client):
    r = greedy_chat(client, logprobs=True, max_tokens=4, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(t.logprob <= 0 and t.top_logprobs == [] for t in content)
    assert greedy_chat(client, max_tokens=4).choices[0].logprobs is None


@needs_top_logprobs
def test_completion_logprobs(client):
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for tok_text, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(logprob)  # greedy: the best one
        assert top.get(tok_text) == pytest.approx(logprob)


# --- the same greedy tokens as the in-process engine -----------------------------------------
def test_greedy_matches_in_process_engine(client, tiny_model_path, tok):
    llm = LLM(str(tiny_model_path), num_blocks=64)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    ids = chat_ids(tok, messages)
    (ref,) = llm.generate(ids, SamplingParams(max_tokens=16, temperature=0))
    r = greedy_chat(client, messages, max_tokens=16)
    assert r.choices[0].message.content == ref.text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(ref.token_ids))
    c = client.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0)
    assert c.choices[0].text == ref.text


# --- program ids ----------------------------------------------------------------------------
def get_program(http, pid) -> dict:
    r = http.get(f"/v1/programs/{pid}")
    assert r.status_code == 200, r.text
    return r.json()


def test_program_ids_by_header_and_body(client, http, tok):
    pid = "api-prog-1"
    usages = []
    for thread in ("a", "b"):
        r = greedy_chat(client, max_tokens=3, extra_headers={"X-Program-Id": pid, "X-Thread-Id": thread})
        assert r.model_extra["program_id"] == pid
        usages.append(r.usage)
    c = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, extra_body={"program_id": pid})
    assert c.model_extra["program_id"] == pid
    usages.append(c.usage)

    p = get_program(http, pid)
    assert (p["id"], p["state"], p["calls_done"], p["calls_running"], p["calls_waiting"]) == (pid, "running", 3, 0, 0)
    assert p["num_prompt_tokens"] == sum(u.prompt_tokens for u in usages)
    assert p["num_output_tokens"] == sum(u.completion_tokens for u in usages)
    assert p["num_threads"] == 3  # "a", "b", and the default thread of the call that named none
    listed = http.get("/v1/programs", params={"state": "running"}).json()["data"]
    assert pid in [q["id"] for q in listed]

    r = http.delete(f"/v1/programs/{pid}")
    assert r.status_code == 200 and r.json()["state"] == "finished"
    assert get_program(http, pid)["state"] == "finished"
    assert pid not in [q["id"] for q in http.get("/v1/programs", params={"state": "running"}).json()["data"]]


def test_call_without_id_is_an_ended_one_call_program(client, http):
    r = greedy_chat(client, max_tokens=2)
    pid = r.model_extra["program_id"]
    p = get_program(http, pid)
    assert (p["state"], p["calls_done"], p["num_output_tokens"]) == ("finished", 1, r.usage.completion_tokens)


def test_program_started_by_post_then_called(client, http):
    r = http.post("/v1/programs", json={"program_id": "api-prog-2", "name": "planner"})
    assert r.status_code == 201 and r.json()["state"] == "running" and r.json()["name"] == "planner"
    greedy_chat(client, max_tokens=2, extra_headers={"X-Program-Id": "api-prog-2"})
    p = get_program(http, "api-prog-2")
    assert (p["name"], p["calls_done"], p["state"]) == ("planner", 1, "running")
    assert http.delete("/v1/programs/api-prog-2").json()["state"] == "finished"


def test_concurrent_calls_of_one_program(srv, http):
    pid = "api-prog-conc"

    async def main():
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as ac:
            return await asyncio.gather(*(
                ac.chat.completions.create(model="tiny", messages=HELLO, max_tokens=5, temperature=0,
                                           extra_headers={"X-Program-Id": pid, "X-Thread-Id": f"t{i}"},
                                           extra_body={"ignore_eos": True})
                for i in range(4)
            ))

    results = asyncio.run(main())
    assert [r.usage.completion_tokens for r in results] == [5] * 4
    assert {r.model_extra["program_id"] for r in results} == {pid}
    p = get_program(http, pid)
    assert (p["calls_done"], p["num_threads"], p["num_output_tokens"]) == (4, 4, 20)
    http.delete(f"/v1/programs/{pid}")


# --- one @agentrt.program, in-process and through agentrt.connect ---------------------------
@agentrt.program(name="agent")
async def agent(question: str) -> tuple[list[str], str | None]:
    greedy = {"max_tokens": 6, "temperature": 0}
    first = await agentrt.chat([{"role": "user", "content": question}], **greedy)
    cont = await agentrt.generate(question + first, **greedy)
    left, right = await agentrt.gather(
        agentrt.chat([{"role": "user", "content": "left " + cont}], **greedy),
        agentrt.generate("right " + cont, **greedy),
    )
    streamed = [t async for t in agentrt.chat_stream([{"role": "user", "content": left + right}], **greedy)]
    return [first, cont, left, right, "".join(streamed)], agentrt.current_program_id()


def test_program_same_outputs_in_process_and_remote(srv, tiny_model_path):
    async def in_process():
        async with agentrt.Runtime(str(tiny_model_path), num_blocks=64) as rt:
            outs, pid = await agent("What is 2+2?")
            return outs, rt.programs[pid]

    async def remote():
        async with agentrt.connect(srv.url):
            return await agent("What is 2+2?")

    local_outs, local_info = anyio.run(in_process)
    remote_outs, pid = anyio.run(remote)
    assert remote_outs == local_outs
    assert (local_info.calls_done, local_info.num_threads) == (5, 3)
    info = srv.state.runtime.programs[pid]  # the server's record of the client's program
    assert (info.calls_done, info.num_threads, info.state) == (5, 3, "finished")  # ended by the client's DELETE
