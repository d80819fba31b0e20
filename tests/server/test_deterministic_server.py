"""`agentrt serve` in deterministic mode, through the official `openai` client, on the real model (bf16 where
the CPU has it, as a user gets by default): the same greedy chat call gives the same text and log-probs
plainly and streamed (the second finds the first's prompt in the prefix cache: the case of the issue), alone
and among concurrent calls."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from agentrt.kernels import cpu
from tests.conftest import assert_all_blocks_free, requires_default_model
from tests.server.live import live_server, tiny_config

pytestmark = [requires_default_model,
              pytest.mark.skipif(not cpu.available(), reason="deterministic mode needs the C++ CPU kernels")]

MESSAGES = [{"role": "system", "content": "You are a friendly assistant."},
            {"role": "user", "content": "Say hello and welcome me to your corner of the world."}]


@pytest.fixture(scope="module")
def srv(default_model_path):
    config = tiny_config(default_model_path, served_model_name="smol",
                         engine={"num_blocks": 512, "max_num_seqs": 32, "deterministic": True,
                                 # the user's default, as the docstring says (tests/conftest.py's AGENTRT_DTYPE=float32
                                 # made it fp32, whose deterministic mode is tests/engine/test_deterministic.py's too)
                                 "dtype": "auto"})
    with live_server(config) as s:
        from agentrt.engine.config import auto_dtype

        assert s.state.runtime.engine.config.dtype == auto_dtype("cpu")[0]
        yield s
        s.wait_idle()
        assert_all_blocks_free(s.state.runtime.engine.core)


def plain(client, messages=MESSAGES):
    r = client.chat.completions.create(model="smol", messages=messages, temperature=0, max_tokens=40, logprobs=True)
    c = r.choices[0]
    return c.message.content, [t.logprob for t in c.logprobs.content]


def streamed(client, messages=MESSAGES):
    text, logprobs = [], []
    for chunk in client.chat.completions.create(model="smol", messages=messages, temperature=0, max_tokens=40,
                                                logprobs=True, stream=True):
        if chunk.choices:
            c = chunk.choices[0]
            text.append(c.delta.content or "")
            logprobs += [t.logprob for t in (c.logprobs.content if c.logprobs and c.logprobs.content else [])]
    return "".join(text), logprobs


def test_streamed_equals_non_streamed(srv, client):
    srv.state.runtime.engine.core.reset_prefix_cache()
    want = plain(client)
    assert want[0] and len(want[1]) == 40
    assert streamed(client) == want  # its prompt now hits the prefix cache
    assert plain(client) == want


def test_same_answer_among_concurrent_calls(srv, client):
    srv.state.runtime.engine.core.reset_prefix_cache()
    want = plain(client)
    others = [[{"role": "user", "content": f"Write a line about the number {i}, in words, at length."}]
              for i in range(12)]
    with ThreadPoolExecutor(16) as pool:
        busy = [pool.submit(streamed if i % 2 else plain, client, m) for i, m in enumerate(others)]
        mine = [pool.submit(plain, client), pool.submit(streamed, client)]
        assert [f.result() for f in mine] == [want, want]
        assert all(f.result()[0] for f in busy)
