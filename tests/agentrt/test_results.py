"""Results keep what was asked: every choice of n > 1, logprobs, usage and finish reasons through
`agentrt.Result`; streams with n > 1 tell choices apart (`agentrt.Chunk.index`); the plain string
stays for the simple case. In-process and through `agentrt.connect`, the same types."""

import anyio
import pytest

import agentrt
from tests.server.live import live_server, tiny_config

MSGS = [{"role": "user", "content": "Name three colours."}]
KW = dict(max_tokens=6, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def rt_kw(tiny_model_path):
    return dict(model=str(tiny_model_path), policy="fcfs", num_blocks=256, max_num_seqs=16)


def run(rt_kw, fn):
    async def main():
        async with agentrt.Runtime(**rt_kw):
            return await fn()

    return anyio.run(main)


def test_plain_call_is_a_string(rt_kw):
    async def fn():
        return await agentrt.chat(MSGS, max_tokens=4), await agentrt.generate("Hello", max_tokens=4)

    chat, gen = run(rt_kw, fn)
    assert type(chat) is str and type(gen) is str


def test_n_returns_every_choice_with_usage(rt_kw):
    async def fn():
        return (await agentrt.chat(MSGS, n=3, **KW), await agentrt.chat(MSGS, **KW, full=True),
                await agentrt.generate("Hello there", n=2, max_tokens=5, temperature=0))

    r, one, gen = run(rt_kw, fn)
    assert isinstance(r, agentrt.Result)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") and isinstance(c.text, str) for c in r.choices)
    assert len({tuple(c.token_ids) for c in r.choices}) > 1  # three completions, not one thrown three times
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.text == r.choices[0].text and r.finish_reason == r.choices[0].finish_reason
    assert one.choices[0].token_ids == r.choices[0].token_ids  # fork 0 draws with the seed itself
    assert len(gen.choices) == 2 and gen.choices[0].token_ids == gen.choices[1].token_ids  # greedy


def test_logprobs_are_returned(rt_kw):
    async def fn():
        return await agentrt.chat(MSGS, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)

    r = run(rt_kw, fn)
    lps = r.choices[0].logprobs
    assert len(lps) == len(r.choices[0].token_ids) == r.usage.completion_tokens
    for tok_id, lp in zip(r.choices[0].token_ids, lps):
        assert lp.token_id == tok_id and lp.logprob <= 0 and len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0].token_id == tok_id  # greedy: the best alternative is the token itself
        assert lp.top_logprobs[0].logprob == pytest.approx(lp.logprob)


def test_stream_with_n_tells_choices_apart(rt_kw):
    async def fn():
        chunks = [c async for c in agentrt.chat_stream(MSGS, n=3, **KW)]
        plain = [p async for p in agentrt.chat_stream(MSGS, **KW)]
        return chunks, plain, await agentrt.chat(MSGS, n=3, **KW)

    chunks, plain, r = run(rt_kw, fn)
    assert all(isinstance(c, agentrt.Chunk) for c in chunks) and all(type(p) is str for p in plain)
    for choice in r.choices:
        mine = [c for c in chunks if c.index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert mine[-1].finish_reason == choice.finish_reason
        assert all(c.finish_reason is None for c in mine[:-1])
    assert "".join(plain) == r.choices[0].text


def test_tool_reply_is_a_result(rt_kw):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]

    async def fn():
        return await agentrt.chat(MSGS, tools=tools, tool_choice="required", max_tokens=40, temperature=0)

    r = run(rt_kw, fn)
    assert isinstance(r, agentrt.ChatReply) and isinstance(r, agentrt.Result)  # ChatReply: the former name
    assert r.finish_reason in ("tool_calls", "length")  # a random tiny model may not close its call
    assert r.message()["role"] == "assistant" and r.usage.completion_tokens > 0


def test_same_results_through_connect(tiny_model_path, rt_kw):
    async def fn():
        r = await agentrt.chat(MSGS, n=2, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
        g = await agentrt.generate("Hello there", n=2, max_tokens=4, temperature=0, logprobs=True)
        chunks = [c async for c in agentrt.chat_stream(MSGS, n=2, max_tokens=5, temperature=0)]
        # logits processors and the output-text options travel too (the bias makes token 100 win at once)
        p = await agentrt.generate("Hello there", max_tokens=6, temperature=0, repetition_penalty=1.5, min_p=0.1,
                                   presence_penalty=0.5, frequency_penalty=0.3, min_tokens=6, logit_bias={100: 30.0},
                                   stop=["e"], include_stop_str_in_output=True, skip_special_tokens=False, full=True)
        # the chat template's options too: the reply goes on from the assistant's words
        prefill = [*MSGS, {"role": "assistant", "content": "Sure, here"}]
        c = await agentrt.chat(prefill, max_tokens=4, temperature=0, add_generation_prompt=False,
                               continue_final_message=True, full=True)
        cs = [x async for x in agentrt.chat_stream(prefill, max_tokens=4, temperature=0, add_generation_prompt=False,
                                                   continue_final_message=True, full=True)]
        return r, g, chunks, p, c, cs

    local = run(rt_kw, fn)

    async def remote(url):
        async with agentrt.connect(url):
            return await fn()

    @agentrt.program(priority=-2)
    async def urgent():
        await agentrt.generate("Hi", max_tokens=1)
        await agentrt.generate("Hi", max_tokens=1, priority=3)

    async def remote_urgent(url):
        async with agentrt.connect(url):
            await urgent()

    with live_server(tiny_config(tiny_model_path)) as srv:
        far = anyio.run(remote, srv.url)
        with pytest.raises(agentrt.InvalidCallError, match="prompt_logprobs"):  # refused, not dropped
            anyio.run(lambda: _connect_chat(srv.url, prompt_logprobs=1))
        seen = []  # a program's class reaches the server with its calls
        add = srv.state.runtime.engine.add_request
        srv.state.runtime.engine.add_request = lambda ids, params, **kw: (seen.append(params.priority),
                                                                           add(ids, params, **kw))[1]
        anyio.run(remote_urgent, srv.url)
        assert seen == [-2, 3]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    prefill = [*MSGS, {"role": "assistant", "content": "Sure, here"}]
    text = tok.apply_chat_template(prefill, tokenize=False, continue_final_message=True)
    assert text.endswith("Sure, here")
    assert local[4].usage.prompt_tokens == far[4].usage.prompt_tokens == len(tok(text, add_special_tokens=False)["input_ids"])
    for a, b in zip(local, far):
        if isinstance(a, list):
            assert [(c.index, c.text) for c in a if c.text] == [(c.index, c.text) for c in b if c.text]
            continue
        assert [c.text for c in a.choices] == [c.text for c in b.choices]
        assert [c.finish_reason for c in a.choices] == [c.finish_reason for c in b.choices]
        assert [(c.token_ids, c.stop_reason) for c in a.choices] == [(c.token_ids, c.stop_reason) for c in b.choices]
        assert a.usage.completion_tokens == b.usage.completion_tokens
        for x, y in zip(a.choices[0].logprobs or (), b.choices[0].logprobs or ()):
            assert (x.token, len(x.top_logprobs)) == (y.token, len(y.top_logprobs))
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


def test_usage_counts_the_prompt_tokens_found_in_the_prefix_cache(tiny_model_path, rt_kw):
    """usage.cached_tokens (OpenAI's usage.prompt_tokens_details.cached_tokens): none on a first call, every
    full block but the one holding the last prompt token (always computed) when the same prompt comes again."""
    long = [{"role": "user", "content": "Name three colours and say why you like them. " * 6}]

    async def fn():
        return [await agentrt.chat(long, max_tokens=2, temperature=0, full=True) for _ in range(2)]

    async def remote(url):
        async with agentrt.connect(url):
            return await fn()

    local = run(rt_kw, fn)
    with live_server(tiny_config(tiny_model_path)) as srv:
        far = anyio.run(remote, srv.url)
    for first, again in (local, far):
        n = first.usage.prompt_tokens
        assert n > 32 and again.usage.prompt_tokens == n
        assert first.usage.cached_tokens == 0
        assert again.usage.cached_tokens == (n - 1) // 16 * 16  # block size 16


async def _connect_chat(url, **sampling):
    async with agentrt.connect(url):
        return await agentrt.chat(MSGS, max_tokens=2, **sampling)
