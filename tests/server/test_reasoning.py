"""`agentrt serve --reasoning-parser`: a reasoning model's thinking apart from its answer, as vLLM returns
it: `reasoning` (and `reasoning_content`) on chat messages and stream deltas, a reasoning item before the
message on /v1/responses, a thinking block before the text on /v1/messages.

The tiny model (random weights, the real tokenizer) never writes think tags by itself: a regex holds its
greedy output to a think block and an answer, and the expected split comes from the output's own token
ids (`return_token_ids`), matched apart from the parser. Responses and Messages take no regex, so there
the route's plan gets the same constraint (`forced`) and the chat endpoint, on the same prompt, is the
peer. A second server's chat template opens the block in the prompt, as DeepSeek-R1's and Qwen3.5's do.
"""

from __future__ import annotations

import json
import re

import anthropic
import anyio
import httpx
import openai
import pytest

import agentrt
import agentrt.server
from agentrt.command import main as cli
from agentrt.engine.structured import Constraint
from agentrt.server import ServerConfig
from tests.server.conftest import check_idle
from tests.server.live import live_server, tiny_config
from tests.test_cli import one_line_error

ASK = [{"role": "user", "content": "Think, then say something."}]
SHAPE = r"<think>([a-z ]{1,20})</think>\n\n([a-z][a-z ]{0,15})"  # the model opens the block (Qwen3)
OPENED = r"([a-z ]{1,20})</think>\n\n([a-z][a-z ]{0,15})"  # the prompt opened it
CALLS = (r'<think>([a-z ]{1,20})</think>\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}'
         r"\n</tool_call>")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# Qwen3.5's style: the generation prompt opens the think block, or closes it with enable_thinking=False
OPEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
)


def regex(shape: str) -> str:
    return shape.replace("([", "[").replace("})", "}")  # the groups out: what the engine is held to


@pytest.fixture(scope="module")
def srv(tiny_model_path):
    config = tiny_config(tiny_model_path, served_model_name="tiny", reasoning_parser="qwen3",
                         trust_request_chat_template=True)
    with live_server(config) as s:
        yield s
        check_idle(s)


@pytest.fixture(scope="module")
def opened(tiny_model_path):
    """A server whose chat template opens the think block in the prompt."""
    config = tiny_config(tiny_model_path, served_model_name="tiny", reasoning_parser="deepseek_r1",
                         chat_template=OPEN_TEMPLATE)
    with live_server(config) as s, openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0) as c:
        yield c
        check_idle(s)


@pytest.fixture
def forced(monkeypatch):
    """Responses and Messages take no regex: Runtime.prepare_chat gives their plan SHAPE's."""
    from agentrt._runtime import Runtime

    prepare = Runtime.prepare_chat

    def prepare_chat(rt, messages, **kw):
        return prepare(rt, messages, **{**kw, "output": Constraint("regex", regex(SHAPE))})

    monkeypatch.setattr(Runtime, "prepare_chat", prepare_chat)


def chat(client, shape=SHAPE, messages=ASK, **kw):
    extra = {"structured_outputs": {"regex": regex(shape)}, "return_token_ids": True,
             **{k: kw.pop(k) for k in ("chat_template_kwargs",) if k in kw}}
    return client.chat.completions.create(model="tiny", messages=messages, extra_body=extra,
                                          **{"max_tokens": 64, "temperature": 0, **kw})


def split_of(tok, ids, shape=SHAPE) -> tuple[str, ...]:
    """The parts of an output in `shape`, matched from its token ids."""
    return re.fullmatch(shape, tok.decode(ids, skip_special_tokens=True)).groups()


def deltas(stream) -> list[tuple[str | None, str | None, str | None]]:
    """(reasoning, reasoning_content, content) of each chunk's delta."""
    out = []
    for chunk in stream:
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            out.append((extra.get("reasoning"), extra.get("reasoning_content"), c.delta.content))
    return out


# --- chat completions ---------------------------------------------------------------------------
def test_chat_message_carries_the_reasoning(client, tok):
    r = chat(client)
    choice = r.choices[0]
    thought, answer = split_of(tok, choice.token_ids)
    assert (choice.message.content, choice.message.reasoning, choice.finish_reason) == (answer, thought, "stop")
    assert choice.message.model_extra == {"reasoning": thought, "reasoning_content": thought}  # both names
    assert r.usage.completion_tokens == len(choice.token_ids)  # the thinking's tokens count as output


def test_chat_stream_sends_the_reasoning_then_the_answer(client, tok):
    r = chat(client)
    thought, answer = split_of(tok, r.choices[0].token_ids)
    got = deltas(chat(client, stream=True, stream_options={"include_usage": True}))
    assert "".join(d[0] or "" for d in got) == thought and "".join(d[2] or "" for d in got) == answer
    assert all(d[0] == d[1] for d in got)  # both names, the same piece
    last_thought = max(i for i, d in enumerate(got) if d[0])
    first_word = min(i for i, d in enumerate(got) if d[2])
    assert last_thought < first_word
    assert not any("<" in (p or "") or ">" in (p or "") for d in got for p in d)  # no piece of a tag shows


def test_a_reply_without_thinking_has_no_reasoning(client, tok):
    r = chat(client, r"([a-z][a-z ]{0,15})")
    (answer,) = split_of(tok, r.choices[0].token_ids, r"([a-z][a-z ]{0,15})")
    assert (r.choices[0].message.content, r.choices[0].message.reasoning) == (answer, None)
    got = deltas(chat(client, r"([a-z][a-z ]{0,15})", stream=True))
    assert not any(d[0] or d[1] for d in got) and "".join(d[2] or "" for d in got) == answer


def test_a_tool_call_after_thinking(client, tok):
    r = chat(client, CALLS, tools=[WEATHER], tool_choice="auto")
    (thought,) = split_of(tok, r.choices[0].token_ids, CALLS)
    m = r.choices[0].message
    assert (m.reasoning, m.content, r.choices[0].finish_reason) == (thought, None, "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in m.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    chunks = list(chat(client, CALLS, tools=[WEATHER], tool_choice="auto", stream=True))
    got = deltas(chunks)
    assert "".join(d[0] or "" for d in got) == thought and not any(d[2] for d in got)
    calls = [t for c in chunks for ch in c.choices for t in ch.delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in calls] == [("get_weather", '{"city": "Paris"}')]
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]


# --- a template that opens the block ------------------------------------------------------------
def test_the_prompt_opens_the_block(opened, tok):
    """Everything until the end tag is thinking; the tiny model never writes one, so all of it is, and a
    grammar (here a regex) waits for the end of the thinking: the output is the free one."""
    free = chat(opened, r"[a-z]")  # the regex never applies
    ids = free.choices[0].token_ids
    r = opened.chat.completions.create(model="tiny", messages=ASK, max_tokens=64, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert tok.decode(r.model_extra["prompt_token_ids"]).endswith("<|im_start|>assistant\n<think>\n")
    assert r.choices[0].token_ids == ids
    thought = tok.decode(ids, skip_special_tokens=True)
    assert (free.choices[0].message.reasoning, free.choices[0].message.content) == (thought, None)
    got = deltas(opened.chat.completions.create(model="tiny", messages=ASK, max_tokens=64, temperature=0, stream=True,
                                                extra_body={"structured_outputs": {"regex": "[a-z]"}}))
    assert "".join(d[0] or "" for d in got) == thought and not any(d[2] for d in got)


def test_a_grammar_starts_when_the_thinking_ends(tiny_model_path, tok):
    """vLLM's structured outputs with a reasoning parser: where the prompt opens the think block, a JSON
    output (or a forced tool call) first thinks freely and holds to its grammar after the end tag. The
    tiny model writes no `</think>`, so the server's parser gets as its end tag two tokens its free
    output writes: up to them the output is the free one (the thinking), after them it is JSON (the answer)."""
    from agentrt._reasoning import ThinkTagParser

    config = tiny_config(tiny_model_path, served_model_name="tiny", reasoning_parser="deepseek_r1",
                         chat_template=OPEN_TEMPLATE)
    with live_server(config) as srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as c:
        free = c.chat.completions.create(model="tiny", messages=ASK, max_tokens=24, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
        ids = free.choices[0].token_ids
        rt = srv.state.runtime
        for k in range(3, 12):  # an end tag the tokenizer spells with those two ids, not written before
            end = tok.decode(ids[k : k + 2])
            if rt.tag_ids(end) == ids[k : k + 2] and end not in tok.decode(ids[: k + 1]) and end.strip():
                break
        else:
            pytest.skip("no two-token tag in the free output round-trips through the tokenizer")
        rt.reasoning = ThinkTagParser("test", end=end)
        r = c.chat.completions.create(model="tiny", messages=ASK, max_tokens=48, temperature=0,
                                      response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": {
                                          "type": "object", "properties": {"ok": {"type": "boolean"}},
                                          "required": ["ok"], "additionalProperties": False}}},
                                      extra_body={"return_token_ids": True})
        out = r.choices[0].token_ids
        assert out[: k + 2] == ids[: k + 2]
        answer = tok.decode(out[k + 2 :], skip_special_tokens=True)
        assert json.loads(answer) in ({"ok": True}, {"ok": False}) and r.choices[0].finish_reason == "stop"
        msg = r.choices[0].message
        assert (msg.reasoning, msg.content) == (tok.decode(ids[:k]), answer)
        check_idle(srv)


def test_enable_thinking_false_closes_the_block_in_the_prompt(opened, tok):
    r = chat(opened, r"([a-z][a-z ]{0,15})", chat_template_kwargs={"enable_thinking": False})
    assert tok.decode(r.model_extra["prompt_token_ids"]).endswith("<think>\n\n</think>\n\n")
    (answer,) = split_of(tok, r.choices[0].token_ids, r"([a-z][a-z ]{0,15})")
    assert (r.choices[0].message.reasoning, r.choices[0].message.content) == (None, answer)


def test_a_reply_cut_short_while_thinking_is_all_reasoning(opened, tok):
    r = chat(opened, r"([a-z ]{60,80})</think>\n\n[a-z]+", max_tokens=3)  # 3 tokens cannot reach the end tag
    thought = tok.decode(r.choices[0].token_ids, skip_special_tokens=True)
    assert re.fullmatch(r"[a-z ]+", thought) and r.choices[0].finish_reason == "length"
    assert (r.choices[0].message.reasoning, r.choices[0].message.content) == (thought, None)


# --- Responses and Messages -----------------------------------------------------------------------
def peer(client, tok) -> tuple[str, str]:
    return split_of(tok, chat(client).choices[0].token_ids)


def end_programs(srv, *responses) -> None:
    """End the programs response chains started, so their KV pins go now."""
    for r in responses:
        assert httpx.delete(f"{srv.url}/v1/programs/{r.model_extra['program_id']}").status_code == 200


def test_responses_reasoning_item(client, tok, srv, forced):
    thought, answer = peer(client, tok)
    r = client.responses.create(model="tiny", input=ASK[0]["content"], max_output_tokens=64, temperature=0)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    item = r.output[0]
    assert item.id.startswith("rs_") and item.summary == [] and item.status == "completed"
    assert [(c.type, c.text) for c in item.content] == [("reasoning_text", thought)]
    assert r.output_text == answer
    assert r.usage.output_tokens_details.reasoning_tokens == len(tok(thought, add_special_tokens=False)["input_ids"])
    # the output sent back as input (as the OpenAI Agents SDK does): the thinking stays out of the prompt
    again = [*ASK, *[o.model_dump(exclude_none=True) for o in r.output], {"role": "user", "content": "Again."}]
    r2 = client.responses.create(model="tiny", input=again, max_output_tokens=64, temperature=0)
    history = [*ASK, {"role": "assistant", "content": answer}, {"role": "user", "content": "Again."}]
    prompt = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert r2.usage.input_tokens == len(tok(prompt, add_special_tokens=False)["input_ids"])
    end_programs(srv, r, r2)


def test_responses_stream_reasoning_events(client, tok, srv, forced):
    thought, answer = peer(client, tok)
    with client.responses.stream(model="tiny", input=ASK[0]["content"], max_output_tokens=64, temperature=0) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    squeezed = [k for i, k in enumerate(kinds) if not (k.endswith(".delta") and kinds[i - 1] == k)]
    assert squeezed == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    pieces = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(e.delta for e in pieces) == thought and {e.output_index for e in pieces} == {0}
    assert [e.text for e in events if e.type == "response.reasoning_text.done"] == [thought]
    assert {e.output_index for e in events if e.type == "response.output_text.delta"} == {1}
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == thought and final.output_text == answer
    end_programs(srv, final)


def test_messages_thinking_block(client, tok, srv, forced):
    thought, answer = peer(client, tok)
    kw = {"model": "tiny", "max_tokens": 64, "messages": ASK, "extra_body": {"temperature": 0}}
    with anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=60) as a:
        m = a.messages.create(**kw)
        with a.messages.stream(**kw) as s:
            events = list(s)
            final = s.get_final_message()
        # an earlier reply's thinking sent back: accepted, left out of the prompt
        back = a.messages.create(**{**kw, "messages": [*ASK, {"role": "assistant", "content": m.content},
                                                       {"role": "user", "content": "Again."}]})
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert (m.content[0].thinking, m.content[0].signature, m.content[1].text) == (thought, "", answer)
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in m.content]
    starts = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    raw = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in raw if d.type == "thinking_delta") == thought
    assert "".join(d.text for d in raw if d.type == "text_delta") == answer
    history = [*ASK, {"role": "assistant", "content": answer}, {"role": "user", "content": "Again."}]
    prompt = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert back.usage.input_tokens + back.usage.cache_read_input_tokens == len(
        tok(prompt, add_special_tokens=False)["input_ids"])


# --- agentrt.connect: the same program as in-process ---------------------------------------------------
async def thinker() -> tuple:
    kw = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "chat_template": OPEN_TEMPLATE}
    r = await agentrt.chat(ASK, full=True, **kw)
    text = await agentrt.chat(ASK, **kw)
    chunks = [c async for c in agentrt.chat_stream(ASK, full=True, **kw)]
    return (r.reasoning, r.text, r.finish_reason, text, "".join(c.reasoning for c in chunks),
            "".join(c.text for c in chunks))


def test_connect_sees_the_reasoning_as_in_process(srv, tiny_model_path):
    async def in_process():
        async with agentrt.Runtime(str(tiny_model_path), num_blocks=64, reasoning_parser="qwen3"):
            return await thinker()

    async def remote():
        async with agentrt.connect(srv.url):
            return await thinker()

    local = anyio.run(in_process)
    assert anyio.run(remote) == local
    reasoning, text, reason, plain, streamed_reasoning, streamed_text = local
    assert reasoning and streamed_reasoning == reasoning  # the prompt opened the block, nothing closed it
    assert (text, reason, plain, streamed_text) == (None, "length", "", "")


# --- the flag -----------------------------------------------------------------------------------
def test_the_flag_reaches_the_server_config(monkeypatch):
    got = {}

    def serve(config, *args, **kw):
        got["config"] = config
        return 0

    monkeypatch.setattr(agentrt.server, "serve", serve)
    assert cli(["serve", "m", "--reasoning-parser", "deepseek_r1"]) == 0
    assert got.pop("config").reasoning_parser == "deepseek_r1"
    assert cli(["serve", "m"]) == 0
    assert got.pop("config").reasoning_parser is None


def test_an_unknown_parser_fails_before_the_model_loads(monkeypatch, capsys):
    monkeypatch.setattr(agentrt.server, "create_app", lambda *a, **k: pytest.fail("the app was built"))
    assert cli(["serve", "--reasoning-parser", "qwen9"]) == 2
    one_line_error(capsys, "'qwen9'", "deepseek_r1", "qwen3")
    with pytest.raises(ValueError, match="unknown reasoning parser 'x'"):
        ServerConfig(reasoning_parser="x")
