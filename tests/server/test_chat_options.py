"""vLLM's request extras on both completion endpoints, through the official `openai` client (its
`extra_body`, as vLLM's users send them) against a live server on the tiny model:

- chat: `add_generation_prompt`, `continue_final_message` (the last assistant message goes on: an
  answer's prefill), `chat_template_kwargs`, `echo` (the reply starts with that last message);
- both: `include_stop_str_in_output`, `skip_special_tokens`, structured outputs as `guided_*` and as
  `structured_outputs` (chat included), `stream_options.continuous_usage_stats`.

Each option is checked against what the tokenizer or a plain request gives; bad values are a 400
naming the field."""

from __future__ import annotations

import re

import openai
import pytest

from tests.conftest import assert_all_blocks_free
from tests.server.live import live_server, tiny_config

MSGS = [{"role": "user", "content": "Say something about the sea."}]
PREFILL = [*MSGS, {"role": "assistant", "content": "The sea is"}]


def chat(client, messages=MSGS, **kw):
    extra = {k: kw.pop(k) for k in list(kw) if k not in ("max_tokens", "temperature", "stream", "stream_options", "n",
                                                        "stop", "seed", "response_format", "extra_headers")}
    return client.chat.completions.create(model="tiny", messages=messages, extra_body=extra or None,
                                          **{"max_tokens": 8, "temperature": 0, **kw})


def error_of(fn, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        fn(**kw)
    return e.value


# --- the chat template ------------------------------------------------------------------------
def test_continue_final_message_leaves_the_last_message_open(client, tok):
    r = chat(client, PREFILL, add_generation_prompt=False, continue_final_message=True)
    expected = tok.apply_chat_template(PREFILL, tokenize=False, continue_final_message=True)
    assert expected.endswith("The sea is")  # the turn stays open: no end-of-turn after it
    assert r.usage.prompt_tokens == len(tok(expected, add_special_tokens=False)["input_ids"])
    closed = chat(client, PREFILL)  # without it, the assistant's message is closed and a new turn opens
    assert closed.usage.prompt_tokens > r.usage.prompt_tokens


def test_continue_final_message_with_echo_returns_the_whole_message(client):
    plain = chat(client, PREFILL, add_generation_prompt=False, continue_final_message=True)
    echoed = chat(client, PREFILL, add_generation_prompt=False, continue_final_message=True, echo=True)
    assert echoed.choices[0].message.content == "The sea is" + plain.choices[0].message.content
    stream = chat(client, PREFILL, add_generation_prompt=False, continue_final_message=True, echo=True, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == echoed.choices[0].message.content
    # echo repeats only an assistant's message: after a user's, the reply is as without echo
    assert chat(client, echo=True).choices[0].message.content == chat(client).choices[0].message.content


def test_add_generation_prompt_false(client, tok):
    r = chat(client, add_generation_prompt=False)
    text = tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=False)
    assert r.usage.prompt_tokens == len(tok(text, add_special_tokens=False)["input_ids"])
    assert chat(client).usage.prompt_tokens > r.usage.prompt_tokens


def test_tokenize_takes_the_same_template_options(srv, client, tok):
    import httpx

    body = {"model": "tiny", "messages": PREFILL, "add_generation_prompt": False, "continue_final_message": True}
    ids = httpx.post(srv.url + "/tokenize", json=body).json()["tokens"]
    text = tok.apply_chat_template(PREFILL, tokenize=False, continue_final_message=True)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]


def test_chat_template_kwargs_reach_the_template(client, srv):
    """The server's template sees the extra variables: one that renders `greeting` when it is set."""
    tok = srv.state.runtime.tokenizer
    saved = tok.chat_template
    tok.chat_template = "{% if greeting %}{{ greeting }} {% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        base = chat(client).usage.prompt_tokens
        r = chat(client, chat_template_kwargs={"greeting": "Ahoy there sailor"})
        assert r.usage.prompt_tokens == len(tok("Ahoy there sailor " + MSGS[0]["content"],
                                                add_special_tokens=False)["input_ids"]) > base
    finally:
        tok.chat_template = saved


@pytest.mark.parametrize("kw,param", [
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt is true by default
    ({"continue_final_message": True, "add_generation_prompt": False, "messages": MSGS}, "messages[0].role"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
])
def test_bad_template_options_are_refused(client, kw, param):
    e = error_of(chat, client=client, **kw)
    assert e.param == param, (kw, e.param, e.message)


# --- the output text --------------------------------------------------------------------------
def test_include_stop_str_in_output_on_both_endpoints(client):
    full = chat(client, max_tokens=16, ignore_eos=True).choices[0].message.content
    needle = next(full[i : i + 3] for i in range(len(full) // 3, len(full) - 3) if full[i : i + 3].strip())
    at = full.index(needle)
    cut = chat(client, max_tokens=16, ignore_eos=True, stop=[needle]).choices[0]
    kept = chat(client, max_tokens=16, ignore_eos=True, stop=[needle], include_stop_str_in_output=True).choices[0]
    assert (cut.message.content, kept.message.content) == (full[:at], full[: at + len(needle)])
    assert cut.finish_reason == kept.finish_reason == "stop"
    streamed = chat(client, max_tokens=16, ignore_eos=True, stop=[needle], include_stop_str_in_output=True, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == full[: at + len(needle)]

    text = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    needle = next(text[i : i + 3] for i in range(len(text) // 3, len(text) - 3) if text[i : i + 3].strip())
    at = text.index(needle)
    for include, expected in ((False, text[:at]), (True, text[: at + len(needle)])):
        r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0,
                                      stop=[needle], extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
        assert r.choices[0].text == expected


def test_skip_special_tokens_false_shows_them(client, tok):
    special = tok.convert_tokens_to_ids("<|im_start|>")
    extra = {"logit_bias": {str(special): 100}, "ignore_eos": True}
    shown = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, temperature=0,
                                      extra_body={**extra, "skip_special_tokens": False})
    hidden = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, temperature=0, extra_body=extra)
    assert shown.choices[0].text == "<|im_start|>" * 2 and hidden.choices[0].text == ""


# --- structured outputs -----------------------------------------------------------------------
def test_structured_outputs_on_chat_and_completions(client):
    choices = ["red", "green", "blue sky"]
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        r = chat(client, n=2, temperature=1.0, seed=5, **extra)
        assert all(c.message.content in choices and c.finish_reason == "stop" for c in r.choices)
        r = client.completions.create(model="tiny", prompt="A colour:", max_tokens=8, extra_body=extra)
        assert r.choices[0].text in choices
    r = chat(client, structured_outputs={"regex": r"[0-9]{3}-[a-c]{2}"}, max_tokens=12)
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", r.choices[0].message.content)
    r = chat(client, guided_regex=r"(yes|no)!", max_tokens=8)
    assert r.choices[0].message.content in ("yes!", "no!")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = chat(client, structured_outputs={"json": schema}, max_tokens=16)
    assert re.fullmatch(r'\{"n": ?[0-9]\}', r.choices[0].message.content)


@pytest.mark.parametrize("kw,param", [
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_json": {"type": "object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
])
def test_bad_constraints_are_refused_on_chat(client, kw, param):
    e = error_of(chat, client=client, **kw)
    assert e.param == param, (kw, e.param, e.message)


# --- usage while streaming --------------------------------------------------------------------
def test_continuous_usage_stats_on_both_endpoints(client):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(chat(client, max_tokens=12, ignore_eos=True, n=2, stream=True, stream_options=opts))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 24
    seen = [c.usage.completion_tokens for c in body]
    assert all(c.usage is not None and c.usage.prompt_tokens == last.usage.prompt_tokens for c in body)
    assert seen == sorted(seen) and seen[-1] == 24 and seen[0] == 0
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in body)
    plain = list(chat(client, max_tokens=12, ignore_eos=True, stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 12

    chunks = list(client.completions.create(model="tiny", prompt=["One", "Two three"], max_tokens=5, stream=True,
                                            stream_options=opts, extra_body={"ignore_eos": True}))
    *body, last = chunks
    assert last.usage.completion_tokens == 10 and last.usage.prompt_tokens == body[0].usage.prompt_tokens
    seen = [c.usage.completion_tokens for c in body]
    assert seen == sorted(seen) and seen[-1] == 10


# --- token ids and stop reasons (vLLM's return_token_ids, stop_reason) -------------------------
def test_return_token_ids_on_chat(client, tok):
    r = chat(client, n=2, temperature=1.0, seed=1, max_tokens=10, return_token_ids=True)
    text = tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    assert r.model_extra["prompt_token_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    for c in r.choices:
        ids = c.model_extra["token_ids"]
        assert len(ids) == r.usage.completion_tokens // 2 or c.finish_reason == "stop"
        assert tok.decode(ids, skip_special_tokens=True) == c.message.content
    streamed = list(chat(client, n=2, temperature=1.0, seed=1, max_tokens=10, return_token_ids=True, stream=True))
    assert streamed[0].model_extra["prompt_token_ids"] == r.model_extra["prompt_token_ids"]
    for i, c in enumerate(r.choices):  # every token once, in order, on the choice's chunks
        ids = [t for ch in streamed for x in ch.choices if x.index == i for t in x.model_extra["token_ids"]]
        assert ids == c.model_extra["token_ids"]
    plain = chat(client)
    assert "token_ids" not in plain.choices[0].model_extra or plain.choices[0].model_extra["token_ids"] is None


def test_return_token_ids_on_completions(client, tok):
    prompts = ["One two", "Three four five"]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    for p, c in zip(prompts, r.choices):
        assert c.model_extra["prompt_token_ids"] == tok(p)["input_ids"]
        assert len(c.model_extra["token_ids"]) == 6 and tok.decode(c.model_extra["token_ids"]) == c.text
    streamed = list(client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0, stream=True,
                                              extra_body={"return_token_ids": True, "ignore_eos": True}))
    for k, c in enumerate(r.choices):
        mine = [x for ch in streamed for x in ch.choices if x.index == k]
        assert mine[0].model_extra["prompt_token_ids"] == c.model_extra["prompt_token_ids"]
        assert all(x.model_extra.get("prompt_token_ids") is None for x in mine[1:])
        assert [t for x in mine for t in x.model_extra["token_ids"]] == c.model_extra["token_ids"]


def test_stop_reason_names_the_stop_string_or_token(client):
    full = chat(client, max_tokens=16, ignore_eos=True)
    content = full.choices[0].message.content
    assert full.choices[0].model_extra["stop_reason"] is None  # "length"
    needle = next(content[i : i + 3] for i in range(len(content) // 3, len(content) - 3) if content[i : i + 3].strip())
    r = chat(client, max_tokens=16, ignore_eos=True, stop=[needle, "\u2603never"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == needle
    ids = chat(client, max_tokens=16, ignore_eos=True, return_token_ids=True).choices[0].model_extra["token_ids"]
    extra = {"ignore_eos": True, "return_token_ids": True}
    gen = client.completions.create(model="tiny", prompt="x", max_tokens=16, temperature=0, extra_body=extra)
    stop_at = gen.choices[0].model_extra["token_ids"][2]
    r = client.completions.create(model="tiny", prompt="x", max_tokens=16, temperature=0, stream=True,
                                  extra_body={**extra, "stop_token_ids": [stop_at]})
    last = [c for c in r if c.choices][-1].choices[0]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop_at
    r = chat(client, max_tokens=16, ignore_eos=True, stop_token_ids=[ids[3]])
    assert r.choices[0].model_extra["stop_reason"] == ids[3]
    streamed = list(chat(client, max_tokens=16, ignore_eos=True, stop_token_ids=[ids[3]], stream=True))
    assert [c for c in streamed if c.choices][-1].choices[0].model_extra["stop_reason"] == ids[3]


# --- priority (vLLM's request field) ------------------------------------------------------------
def test_priority_lets_an_urgent_call_past_a_long_one(tiny_model_path):
    """One seat, FCFS (which never preempts by itself): a long call of class 5 runs; an urgent call of
    class -1 displaces it (a preemption), and the long one then completes (recomputed, nothing lost)."""
    import httpx

    with live_server(tiny_config(tiny_model_path, policy="fcfs", engine={"max_num_seqs": 1})) as srv:
        long_body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                     "stream": True, "priority": 5}
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            with http.stream("POST", "/v1/completions", json=long_body) as stream:
                lines = stream.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))  # the long call runs
                r = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, "temperature": 0,
                                                            "priority": -1})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
                rest = [line for line in lines if line.startswith("data:")]
            assert rest[-1] == "data: [DONE]"
            finished = [c for c in rest[:-1] if '"finish_reason":"length"' in c]
            assert finished  # the long call completed after the urgent one
            metrics = http.get("/metrics").text
        preemptions = [float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("agentrt:num_preemptions_total")]
        assert preemptions and preemptions[0] >= 1
        srv.wait_idle()
        assert_all_blocks_free(srv.state.runtime.engine.core)


def test_priority_must_be_an_int(client):
    e = error_of(chat, client=client, priority="high")
    assert e.param == "priority"
    e = error_of(chat, client=client, priority=2**40)
    assert e.param == "priority"


def test_a_programs_priority_applies_to_its_calls(srv, client, http, monkeypatch):
    r = http.post("/v1/programs", json={"program_id": "prio-prog", "priority": -3})
    assert r.status_code == 201 and r.json()["priority"] == -3
    rt = srv.state.runtime
    seen = []
    submit = rt.submit
    monkeypatch.setattr(rt, "submit", lambda ids, params, **kw: (seen.append(kw["program_id"]), submit(ids, params, **kw))[1])
    add = rt.engine.add_request
    monkeypatch.setattr(rt.engine, "add_request", lambda ids, params, **kw: (seen.append(params.priority),
                                                                             add(ids, params, **kw))[1])
    headers = {"X-Program-Id": "prio-prog"}
    chat(client, extra_headers=headers)
    chat(client, extra_headers=headers, priority=2)  # a call's own class wins
    chat(client)  # another program: class 0
    assert seen[1::2] == [-3, 2, 0] and seen[0] == seen[2] == "prio-prog"
    assert http.get("/v1/programs/prio-prog").json()["priority"] == -3
    bad = http.post("/v1/programs", json={"priority": 2**40})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
    assert http.delete("/v1/programs/prio-prog").status_code == 200


def test_a_request_brings_its_own_template_only_where_trusted(tiny_model_path, client, tok):
    """vLLM's request `chat_template`: refused (400 naming it) unless the server trusts request templates;
    there it renders this call's prompt (chat and /tokenize alike), and one that does not compile is a
    400 naming it."""
    import httpx

    own = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    assert error_of(chat, client=client, chat_template=own).param == "chat_template"
    with live_server(tiny_config(tiny_model_path, served_model_name="tiny", trust_request_chat_template=True)) as s:
        with openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60) as trusted:
            r = chat(trusted, chat_template=own)
            expected = tok(f"[user] {MSGS[0]['content']}\n[assistant]", add_special_tokens=False)["input_ids"]
            assert r.usage.prompt_tokens == len(expected) != chat(trusted).usage.prompt_tokens
            ids = httpx.post(s.url + "/tokenize", json={"messages": MSGS, "chat_template": own}).json()["tokens"]
            assert ids == expected
            assert error_of(chat, client=trusted, chat_template="{% for m in messages %}").param == "chat_template"
        s.wait_idle()
