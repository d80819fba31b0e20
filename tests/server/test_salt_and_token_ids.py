"""vLLM's `cache_salt` (chat, completions, Responses), `return_tokens_as_token_ids` (chat and completions,
streamed and not, and the server's `--return-tokens-as-token-ids`) and `spaces_between_special_tokens`
(accepted; the tokenizers' decode ignores it) against a live server on the tiny model."""

from __future__ import annotations

import json
import re

import pytest

import agentrt.server
from agentrt.command import main as cli
from agentrt.server.calls import engine_salt
from tests.server.live import bad_request as error

ID = re.compile(r"^token_id:\d+$")


def post(http, path, **body) -> dict:
    r = http.post(path, json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    return r.json()


def events(http, path, **body) -> list[dict]:
    with http.stream("POST", path, json={"model": "tiny", "stream": True, **body}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


# --- cache_salt -------------------------------------------------------------------------------------
def test_engine_salt_pairs_the_owner_with_the_request_salt():
    assert engine_salt(None, None) is None and engine_salt("fp1", None) == "fp1"  # unchanged without a salt
    pairs = [engine_salt(o, s) for o in (None, "fp1", "fp2") for s in ("fp1", "fp2", "x", '"]', '", "x')]
    assert len(set(pairs)) == len(pairs)  # no two (owner, salt) pairs share blocks
    assert not {None, "fp1", "fp2"} & set(pairs)  # nor does a salted call share a key's unsalted blocks


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_cache_salt_keeps_cached_prefixes_apart(http, path):
    words = " ".join(f"w{i}" for i in range(60))  # several blocks, a prompt no other test sends
    if path == "/v1/completions":
        prompt: dict = {"prompt": f"{path} {words}"}
    else:
        prompt = {"messages": [{"role": "user", "content": f"{path} {words}"}]}

    def cached(**salt) -> int:
        return post(http, path, max_tokens=1, **prompt, **salt)["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="a") == 0
    assert cached(cache_salt="a") > 0  # same salt: the prefix is shared
    assert cached(cache_salt="b") == 0  # another salt
    assert cached() == 0  # no salt after salted calls only
    assert cached() > 0


def test_responses_take_a_cache_salt(http):
    def cached(**salt) -> int:
        r = http.post("/v1/responses", json={"model": "tiny", "input": "tell me " + "about the sea " * 12,
                                             "max_output_tokens": 1, "store": False, **salt})
        assert r.status_code == 200, r.text
        http.delete(f"/v1/programs/{r.headers['x-program-id']}")  # a response chain's program pins its prefix
        return r.json()["usage"]["input_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="r1") == 0
    assert cached(cache_salt="r1") > 0
    assert cached(cache_salt="r2") == 0


@pytest.mark.parametrize("salt", ["", "x" * 257, 7, ["a"]])
def test_a_bad_cache_salt_is_a_400_naming_it(http, salt):
    body = {"cache_salt": salt}
    assert error(http, "/v1/completions", prompt="hi", **body)["param"] == "cache_salt"
    assert error(http, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], **body)["param"] == "cache_salt"
    assert error(http, "/v1/responses", input="hi", **body)["param"] == "cache_salt"
    assert post(http, "/v1/completions", prompt="hi", max_tokens=1, cache_salt="x" * 256)  # the longest allowed


# --- return_tokens_as_token_ids ---------------------------------------------------------------------
GREEDY = dict(max_tokens=6, temperature=0, ignore_eos=True, return_token_ids=True)
MSGS = [{"role": "user", "content": "Name three colours."}]


def test_completion_logprobs_name_token_ids(http, tok):
    plain = post(http, "/v1/completions", prompt="The sea is", logprobs=3, **GREEDY)["choices"][0]
    ids = post(http, "/v1/completions", prompt="The sea is", logprobs=3, return_tokens_as_token_ids=True,
               **GREEDY)["choices"][0]
    assert ids["token_ids"] == plain["token_ids"]
    assert ids["logprobs"]["tokens"] == [f"token_id:{t}" for t in plain["token_ids"]]
    assert ids["logprobs"]["token_logprobs"] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-4)
    assert ids["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]  # offsets stay the text's
    for t, top, plain_top in zip(ids["token_ids"], ids["logprobs"]["top_logprobs"], plain["logprobs"]["top_logprobs"]):
        assert all(ID.match(k) for k in top) and top[f"token_id:{t}"] == max(top.values())  # greedy: the best
        assert sorted(top.values()) == pytest.approx(sorted(plain_top.values()), abs=1e-4)
    # the echoed prompt's tokens too
    echoed = post(http, "/v1/completions", prompt="The sea is", logprobs=1, echo=True, max_tokens=1, temperature=0,
                  return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    prompt_ids = tok("The sea is")["input_ids"]
    assert echoed["tokens"][: len(prompt_ids)] == [f"token_id:{t}" for t in prompt_ids]


def test_streamed_completion_logprobs_name_token_ids(http):
    chunks = events(http, "/v1/completions", prompt="The sea is", logprobs=2, return_tokens_as_token_ids=True,
                    **GREEDY)
    tokens = [t for c in chunks for ch in c["choices"] if ch["logprobs"] for t in ch["logprobs"]["tokens"]]
    ids = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"] or []]
    assert len(ids) == 6 and tokens == [f"token_id:{t}" for t in ids]
    tops = [k for c in chunks for ch in c["choices"] if ch["logprobs"] for top in ch["logprobs"]["top_logprobs"]
            for k in top]
    assert tops and all(ID.match(k) for k in tops)


def test_chat_logprobs_name_token_ids(http, tok):
    plain = post(http, "/v1/chat/completions", messages=MSGS, logprobs=True, top_logprobs=2, **GREEDY)["choices"][0]
    ids = post(http, "/v1/chat/completions", messages=MSGS, logprobs=True, top_logprobs=2,
               return_tokens_as_token_ids=True, **GREEDY)["choices"][0]
    assert ids["token_ids"] == plain["token_ids"]
    for t, entry, p in zip(ids["token_ids"], ids["logprobs"]["content"], plain["logprobs"]["content"]):
        assert entry["token"] == f"token_id:{t}" and entry["logprob"] == pytest.approx(p["logprob"], abs=1e-4)
        assert entry["bytes"] == p["bytes"] == list(tok.decode([t]).encode())  # bytes stay the token's text's
        tops = entry["top_logprobs"]
        assert all(ID.match(x["token"]) for x in tops) and tops[0]["token"] == entry["token"]  # greedy: the best
        texts = [tok.decode([int(x["token"].removeprefix("token_id:"))]) for x in tops]
        assert sorted(texts) == sorted(x["token"] for x in p["top_logprobs"])
        assert [x["bytes"] for x in tops] == [list(text.encode()) for text in texts]


def test_streamed_chat_logprobs_name_token_ids(http):
    chunks = events(http, "/v1/chat/completions", messages=MSGS, logprobs=True, top_logprobs=1,
                    return_tokens_as_token_ids=True, **GREEDY)
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    content = [e for c in chunks for ch in c["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]]
    assert len(ids) == 6 and [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
    assert all(ID.match(x["token"]) for e in content for x in e["top_logprobs"])


def test_the_server_flag_is_the_default_a_request_overrides(http, srv):
    srv.state.config.return_tokens_as_token_ids = True
    try:
        on = post(http, "/v1/completions", prompt="The sea is", logprobs=0, **GREEDY)["choices"][0]
        assert on["logprobs"]["tokens"] == [f"token_id:{t}" for t in on["token_ids"]]
        off = post(http, "/v1/chat/completions", messages=MSGS, logprobs=True, return_tokens_as_token_ids=False,
                   **GREEDY)["choices"][0]
        assert not any(ID.match(e["token"]) for e in off["logprobs"]["content"])
    finally:
        srv.state.config.return_tokens_as_token_ids = False


def test_serve_takes_the_flag(monkeypatch):
    got = {}
    monkeypatch.setattr(agentrt.server, "serve", lambda config, *a, **k: got.update(config=config) or 0)
    assert cli(["serve", "--return-tokens-as-token-ids"]) == 0
    assert got["config"].return_tokens_as_token_ids is True
    assert cli(["serve"]) == 0
    assert got["config"].return_tokens_as_token_ids is False


def test_a_non_bool_return_tokens_as_token_ids_is_a_400(http):
    assert error(http, "/v1/completions", prompt="hi", return_tokens_as_token_ids="yes")["param"] == \
        "return_tokens_as_token_ids"


# --- spaces_between_special_tokens ------------------------------------------------------------------
def test_spaces_between_special_tokens_is_accepted_and_the_decode_ignores_it(http, tok):
    ids = tok.convert_tokens_to_ids(tok.all_special_tokens[:2]) + tok("a b", add_special_tokens=False)["input_ids"]
    ids += tok.convert_tokens_to_ids(tok.all_special_tokens[:2])
    texts = {tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=s) for s in (True, False)}
    assert len(texts) == 1  # why the field changes nothing: the decode gives one text either way
    on = post(http, "/v1/completions", prompt="The sea is", spaces_between_special_tokens=True, **GREEDY)
    off = post(http, "/v1/completions", prompt="The sea is", spaces_between_special_tokens=False, **GREEDY)
    assert on["choices"][0]["text"] == off["choices"][0]["text"]
    assert error(http, "/v1/completions", prompt="hi", spaces_between_special_tokens="no")["param"] == \
        "spaces_between_special_tokens"
