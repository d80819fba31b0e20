"""The logits processors over HTTP: OpenAI's penalties and logit_bias, vLLM's repetition_penalty,
min_p and min_tokens, on both completion endpoints (the engine's semantics are tested in
tests/engine/test_sampling_parity.py; here: they arrive, and bad values are a 400 naming them)."""

from __future__ import annotations

import httpx
import pytest

from tests.server.live import live_server, tiny_config


@pytest.fixture(scope="module")
def srv(tiny_model_path):
    with live_server(tiny_config(tiny_model_path)) as s:
        yield s


def _text(srv, path: str, **body) -> str:
    r = httpx.post(srv.url + path, json={"max_tokens": 8, "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.mark.parametrize("path, prompt", [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                          ("/v1/completions", {"prompt": "a b c"})])
def test_processors_reach_the_engine(srv, path, prompt, monkeypatch):
    rt = srv.state.runtime
    seen = []
    submit = rt.submit
    monkeypatch.setattr(rt, "submit", lambda ids, params, **kw: (seen.append(params), submit(ids, params, **kw))[1])
    _text(srv, path, **prompt, frequency_penalty=1.5, presence_penalty=-0.5, repetition_penalty=1.2, min_p=0.05,
          min_tokens=2, logit_bias={"42": 3.5, "7": -100})
    (p,) = seen
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty, p.min_p, p.min_tokens) == (1.5, -0.5, 1.2, 0.05, 2)
    assert p.logit_bias == {42: 3.5, 7: -100.0}


def test_logit_bias_forces_a_token(srv):
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a b c", "max_tokens": 3, "temperature": 0,
                                                      "logprobs": 0, "logit_bias": {"42": 100}}, timeout=60)
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    assert tokens == [srv.state.runtime.tokenizer.decode([42])] * 3


@pytest.mark.parametrize("field, value", [("presence_penalty", 5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                                          ("min_p", 1.5), ("min_tokens", -1), ("logit_bias", {"x": 1}),
                                          ("logit_bias", {"1": 500})])
def test_bad_processor_values_are_a_400_naming_them(srv, field, value):
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2, field: value}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
