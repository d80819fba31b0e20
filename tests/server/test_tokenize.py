"""The routes a vLLM client finds besides the completions: `/tokenize` gives exactly the token ids the
completion endpoints send to the engine (a prompt, or a conversation with its tools), `/detokenize` their
text, `GET /v1/models/{model}` the model (OpenAI's retrieve), `/version` the version."""

from __future__ import annotations

import openai
import pytest

from tests.server.live import live_server, tiny_config

MESSAGES = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is 2 + 2?"}]
TOOL = {"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                         "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def srv(tiny_model_path):
    with live_server(tiny_config(tiny_model_path, served_model_name="tiny")) as s:
        yield s


def test_tokenize_a_prompt_as_completions_does(srv, http, client):
    text = "The quick brown fox jumps over the lazy dog."
    tok = srv.state.runtime.tokenizer
    r = http.post("/tokenize", json={"model": "tiny", "prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == tok(text)["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == srv.state.max_model_len
    assert r["token_strs"] == [tok.decode([t]) for t in r["tokens"]]
    done = client.completions.create(model="tiny", prompt=text, max_tokens=1)
    assert done.usage.prompt_tokens == r["count"]
    assert http.post("/tokenize", json={"prompt": text}).json().get("token_strs") is None
    back = http.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": tok.decode(r["tokens"])}


@pytest.mark.parametrize("tools", [None, [TOOL]], ids=["plain", "tools"])
def test_tokenize_a_conversation_as_chat_does(http, client, tools):
    body = {"messages": MESSAGES, **({"tools": tools} if tools else {})}
    r = http.post("/tokenize", json=body).json()
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, **({"tools": tools} if tools else {}))
    assert r["count"] == chat.usage.prompt_tokens == len(r["tokens"])
    bare = http.post("/tokenize", json={**body, "add_generation_prompt": False}).json()
    assert bare["count"] < r["count"] and r["tokens"][: bare["count"]] == bare["tokens"]


@pytest.mark.parametrize("body,param", [
    ({}, "prompt"),
    ({"prompt": "hi", "messages": MESSAGES}, "messages"),
    ({"prompt": "hi", "tools": [TOOL]}, "tools"),
    ({"messages": []}, "messages"),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].name"),
], ids=["neither", "both", "tools-without-messages", "empty-messages", "bad-tool"])
def test_tokenize_refuses_what_it_cannot_read(http, body, param):
    r = http.post("/tokenize", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_detokenize_refuses_ids_out_of_the_vocabulary(srv, http):
    vocab = srv.state.vocab_size
    r = http.post("/detokenize", json={"tokens": [1, vocab]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[1]" and str(vocab) in r.json()["error"]["message"]
    r = http.post("/detokenize", json={"tokens": [-1]})
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_retrieve_a_stored_response(client):
    made = client.responses.create(model="tiny", input="Say hello.", max_output_tokens=3, temperature=0)
    again = client.responses.retrieve(made.id)
    assert again.model_dump() == made.model_dump()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nonexistent")
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(made.id)


def test_retrieve_the_model_and_the_version(client, http):
    m = client.models.retrieve("tiny")
    assert m.id == "tiny" and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    v = http.get("/version")
    assert v.status_code == 200 and v.json()["version"]


def test_tool_choice_none_keeps_the_tools_unless_the_server_excludes_them(tiny_model_path, http, client):
    """By default a tool_choice "none" call still describes its tools (its prompt is /tokenize's with the
    tools); `--exclude-tools-when-tool-choice-none` (vLLM's flag) leaves them out."""
    with_tools = http.post("/tokenize", json={"messages": MESSAGES, "tools": [TOOL]}).json()["count"]
    without = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert with_tools > without

    def prompt_tokens(c: openai.OpenAI) -> int:
        return c.chat.completions.create(model="tiny", messages=MESSAGES, tools=[TOOL], tool_choice="none",
                                         max_tokens=1).usage.prompt_tokens

    assert prompt_tokens(client) == with_tools
    config = tiny_config(tiny_model_path, served_model_name="tiny", exclude_tools_when_tool_choice_none=True)
    with live_server(config) as other, openai.OpenAI(base_url=other.url + "/v1", api_key="x", max_retries=0) as c:
        assert prompt_tokens(c) == without


def test_input_items_of_a_chain(client, http):
    """`GET /v1/responses/{id}/input_items` (the SDK's `responses.input_items.list`): what the model read,
    earlier turns of the chain and tool results included, newest first by default, in pages."""
    first = client.responses.create(model="tiny", input="Say hello.", instructions="Be brief.", max_output_tokens=3,
                                    temperature=0)
    call = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 1}'}
    out = {"type": "function_call_output", "call_id": "call_1", "output": "2"}
    second = client.responses.create(model="tiny", previous_response_id=first.id, max_output_tokens=3,
                                     temperature=0, input=[{"role": "user", "content": "Add."}, call, out])
    items = list(client.responses.input_items.list(second.id, order="asc"))
    reply = first.output[0].content[0].text
    assert [(i.type, getattr(i, "role", None)) for i in items] == [
        ("message", "user"), ("message", "assistant"), ("message", "user"), ("function_call", None),
        ("function_call_output", None)]
    assert items[0].content[0].text == "Say hello." and items[0].content[0].type == "input_text"
    assert items[1].content[0].text == reply and items[1].content[0].type == "output_text"
    assert (items[3].call_id, items[3].name, items[3].arguments) == ("call_1", "add", '{"a": 1}')
    assert (items[4].call_id, items[4].output) == ("call_1", "2")
    assert [i.id for i in client.responses.input_items.list(second.id)] == [i.id for i in reversed(items)]
    assert len({i.id for i in items}) == 5
    page = http.get(f"/v1/responses/{second.id}/input_items", params={"order": "asc", "limit": 2}).json()
    assert [d["id"] for d in page["data"]] == [items[0].id, items[1].id] and page["has_more"]
    assert (page["first_id"], page["last_id"]) == (items[0].id, items[1].id)
    rest = http.get(f"/v1/responses/{second.id}/input_items",
                    params={"order": "asc", "limit": 10, "after": page["last_id"]}).json()
    assert [d["id"] for d in rest["data"]] == [i.id for i in items[2:]] and not rest["has_more"]
    for params, field in (({"limit": 0}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                          ({"after": "msg_nope"}, "after")):
        r = http.get(f"/v1/responses/{second.id}/input_items", params=params)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert [i.type for i in client.responses.input_items.list(first.id)] == ["message"]
