"""vLLM's `use_beam_search` over HTTP: /v1/completions and /v1/chat/completions return the beams as the n
choices, best first, equal to the in-process engine's `LLM.beam_search` on the same prompt; every step's
beams are calls of one program; what beam search cannot combine with is a 400 naming the field. And in a
program, `agentrt.beam_search`, in-process and through `agentrt.connect`."""

from __future__ import annotations

import anyio
import pytest

import agentrt
from agentrt.engine import LLM, BeamSearchParams

PROMPT = [101, 2045, 3306, 712, 88, 17, 4000, 930] * 5  # two full blocks the beams share


@pytest.fixture(scope="module")
def expected(tiny_model_path):
    llm = LLM(str(tiny_model_path), num_blocks=64)
    return llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True,
                                                      length_penalty=0.8))[0]


def test_completions_return_the_beams(http, expected, srv):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "use_beam_search": True, "n": 3, "max_tokens": 5,
                                           "ignore_eos": True, "length_penalty": 0.8, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["token_ids"] for c in body["choices"]] == [s.tokens[len(PROMPT):] for s in expected.sequences]
    assert [c["text"] for c in body["choices"]] == [s.text for s in expected.sequences]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 15 and body["usage"]["prompt_tokens"] == len(PROMPT)
    info = srv.state.runtime.programs.get(r.headers["x-program-id"])
    assert info.state != "running" and info.calls_done == 1 + 4 * 3  # one program: every step's beams its calls
    assert info.num_prefix_hit_tokens > 0  # the beams' shared tokens came from the prefix cache


def test_chat_returns_the_beams(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4,
                                       extra_body={"use_beam_search": True, "ignore_eos": True})
    assert len(r.choices) == 2 and r.choices[0].message.content != r.choices[1].message.content
    assert [c.finish_reason for c in r.choices] == ["length", "length"]


@pytest.mark.parametrize("extra, field", [({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"),
                                          ({"n": 11}, "n"), ({"echo": True}, "echo"),
                                          ({"structured_outputs": {"regex": "a+"}}, "use_beam_search")])
def test_what_beam_search_does_not_combine_with(http, extra, field):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "use_beam_search": True, "max_tokens": 3, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_programs_run_beam_searches_in_process_and_connected(tiny_model_path, srv, expected):
    """`agentrt.beam_search` in a program: its steps are the program's calls, in-process and through
    `agentrt.connect`; the beams are the engine's."""
    want = [s.tokens[len(PROMPT):] for s in expected.sequences]

    @agentrt.program
    async def search() -> tuple[list[list[int]], str]:
        r = await agentrt.beam_search(PROMPT, beam_width=3, max_tokens=5, ignore_eos=True, length_penalty=0.8)
        return [c.token_ids for c in r.choices], agentrt.current_program_id()

    async def main():
        async with agentrt.Runtime(str(tiny_model_path), num_blocks=64) as rt:
            beams, pid = await search()
            assert beams == want
            info = rt.programs[pid]
            assert info.calls_done == 1 + 4 * 3 and info.state == "finished"
            with pytest.raises(agentrt.InvalidCallError, match="beam_width"):
                await agentrt.beam_search(PROMPT, beam_width=0, max_tokens=2)
        async with agentrt.connect(srv.url):
            beams, _ = await search()
            assert beams == want

    anyio.run(main)
