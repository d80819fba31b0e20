"""The model's recommended sampling (vLLM's --generation-config): generation_config.json's temperature,
top_p, top_k, min_p, repetition_penalty and max_new_tokens are the defaults of fields a request leaves
unset, in the engine (`LLM.generate` without params), in-process programs and over HTTP; a request's own
values win; "vllm" ignores the file; overrides go on top; a bad value fails before the model loads."""

from __future__ import annotations

import json
import shutil

import anyio
import httpx
import pytest

import agentrt
from agentrt.engine import LLM, SamplingParams
from agentrt.engine.generation_config import generation_defaults
from tests.server.live import live_server, tiny_config

RECOMMENDED = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 7,
               "do_sample": True}


@pytest.fixture(scope="module")
def model(tiny_model_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("genconf") / "model"
    shutil.copytree(tiny_model_path, path)
    cfg = json.loads((path / "generation_config.json").read_text()) if (path / "generation_config.json").exists() else {}
    (path / "generation_config.json").write_text(json.dumps({**cfg, **RECOMMENDED}))
    return path


def test_defaults_come_from_the_file(model, tiny_model_path, tmp_path):
    want = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 7}
    assert generation_defaults(model) == want
    assert generation_defaults(model, "vllm") == {}
    assert generation_defaults(tiny_model_path, str(model)) == want  # another folder's file
    assert generation_defaults(model, "auto", {"temperature": 0.1})["temperature"] == 0.1
    assert generation_defaults(model, "vllm", {"max_new_tokens": 3}) == {"max_tokens": 3}
    with pytest.raises(ValueError, match="unknown field 'temp'"):
        generation_defaults(model, "auto", {"temp": 0.1})
    with pytest.raises(ValueError, match="not a directory"):
        generation_defaults(model, str(tmp_path / "nope"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match=r"generation_config.json.*temperature"):
        generation_defaults(model, str(bad))
    with pytest.raises(ValueError, match="temperature"):
        LLM(str(model), override_generation_config={"temperature": -2}, num_blocks=8)  # before the model loads


def test_engine_uses_them_when_given_no_params(model):
    llm = LLM(str(model), num_blocks=32)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (0.6, 0.9, 20, 1.05, 7)
    out = llm.generate(["Hello there"], progress=False)[0].outputs[0]
    assert len(out.token_ids) == 7 or out.finish_reason == "stop"
    plain = LLM(str(model), num_blocks=32, generation_config="vllm").get_default_sampling_params()
    assert plain == SamplingParams()


def test_programs_and_the_server_fill_unset_fields(model):
    async def main():
        async with agentrt.Runtime(str(model), num_blocks=32):
            r = await agentrt.generate("Hello there", full=True, ignore_eos=True)  # max_tokens from the file
            assert len(r.choices[0].token_ids) == 7
            r = await agentrt.generate("Hello there", full=True, ignore_eos=True, max_tokens=3)  # the call wins
            assert len(r.choices[0].token_ids) == 3

    anyio.run(main)
    seen: list[SamplingParams] = []
    with live_server(tiny_config(model, served_model_name="tiny")) as srv:
        core = srv.state.runtime.engine.core
        add = core.add_checked  # the engine client admits a request, then the engine thread adds it

        def spy(checked):
            seen.append(checked.params)
            return add(checked)

        core.add_checked = spy
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "ignore_eos": True})
            assert r.json()["usage"]["completion_tokens"] == 7
            r = http.post("/v1/completions", json={"prompt": "Hello", "ignore_eos": True})
            assert r.json()["usage"]["completion_tokens"] == 16  # OpenAI's (and vLLM's) default for completions
            http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "temperature": 0, "min_p": 0.2, "max_tokens": 2})
        core.add_checked = add
    unset, _, chat = seen
    assert (unset.temperature, unset.top_p, unset.top_k, unset.repetition_penalty) == (0.6, 0.9, 20, 1.05)
    assert (chat.temperature, chat.min_p, chat.max_tokens, chat.top_k) == (0.0, 0.2, 2, 20)
