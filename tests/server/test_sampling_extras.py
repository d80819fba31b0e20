"""vLLM's `allowed_token_ids`, `bad_words` and `truncate_prompt_tokens` on both completion endpoints, and
vLLM's `POST /reset_prefix_cache`, against a live server on the tiny model; the same sampling arguments
in-process (`agentrt.generate` / `agentrt.chat`) and through `agentrt.connect`.

Each is checked against what a plain request gives (the greedy output a bad word is taken from, the cut
prompt given directly); bad values are a 400 naming the field."""

from __future__ import annotations

import anyio

import agentrt
from tests.server.live import bad_request as error

MSGS = [{"role": "user", "content": "Say something about the sea and the wind."}]
PROMPT = [311, 4090, 77, 1500, 23, 9000, 42, 311, 77, 1500, 23, 9000]
ALLOWED = [42, 787, 1000, 9805, 30000]


def complete(http, **body):
    r = http.post("/v1/completions", json={"model": "tiny", "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(http, **body):
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


# --- allowed_token_ids ----------------------------------------------------------------------------
def test_allowed_token_ids_restrict_every_sampled_token(http):
    sampled = dict(max_tokens=40, temperature=1.0, seed=5, ignore_eos=True, allowed_token_ids=ALLOWED)
    comp = complete(http, prompt=PROMPT, n=2, logprobs=2, **sampled)
    for c in comp["choices"]:
        assert len(c["token_ids"]) == 40 and set(c["token_ids"]) <= set(ALLOWED)
        assert all(lp <= 0 for lp in c["logprobs"]["token_logprobs"])
    done = chat(http, **sampled)
    assert set(done["choices"][0]["token_ids"]) <= set(ALLOWED) and len(set(done["choices"][0]["token_ids"])) > 1
    streamed = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "stream": True, **sampled})
    assert streamed.status_code == 200 and "data: [DONE]" in streamed.text
    top = chat(http, max_tokens=2, allowed_token_ids=ALLOWED, logprobs=True, top_logprobs=7)["choices"][0]["logprobs"]
    for entry in top["content"]:  # the tokens past the allowed ones are impossible: -9999 as vLLM shows -inf
        assert [t["logprob"] == -9999.0 for t in entry["top_logprobs"]] == [False] * 5 + [True] * 2


def test_allowed_token_ids_out_of_the_vocabulary_is_a_400_naming_it(http, srv):
    vocab = srv.state.vocab_size
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MSGS})):
        err = error(http, path, **body, allowed_token_ids=[5, vocab + 7])
        assert err["param"] == "allowed_token_ids" and str(vocab + 7) in err["message"]
    err = error(http, "/v1/completions", prompt=PROMPT, allowed_token_ids=[])
    assert err["param"] == "allowed_token_ids"
    err = error(http, "/v1/completions", prompt=PROMPT, allowed_token_ids=[-3])
    assert err["param"] == "allowed_token_ids" and "-3" in err["message"]


# --- bad_words ------------------------------------------------------------------------------------
def test_a_bad_word_from_the_greedy_output_is_no_longer_generated(http, tok):
    greedy = dict(max_tokens=24, temperature=0, ignore_eos=True)
    for endpoint, body in ((complete, {"prompt": PROMPT}), (chat, {})):
        free = endpoint(http, **body, **greedy)["choices"][0]["token_ids"]
        word = next(w for t in free if (w := tok.decode([t])).strip()
                    and tok(w.lstrip(), add_special_tokens=False)["input_ids"] == [t])  # the word alone is that token
        banned = endpoint(http, **body, **greedy, bad_words=[word])["choices"][0]
        first = free.index(tok(word.lstrip(), add_special_tokens=False)["input_ids"][0])
        assert banned["token_ids"][:first] == free[:first] and free[first] not in banned["token_ids"]
    err = error(http, "/v1/chat/completions", messages=MSGS, bad_words=["fine", " "])
    assert err["param"] == "bad_words"


# --- truncate_prompt_tokens -----------------------------------------------------------------------
def test_truncated_prompt_is_the_cut_prompt(http, tok):
    greedy = dict(max_tokens=8, temperature=0, ignore_eos=True)
    cut = complete(http, prompt=PROMPT, truncate_prompt_tokens=5, echo=True, **greedy)
    given = complete(http, prompt=PROMPT[-5:], **greedy)
    assert cut["usage"]["prompt_tokens"] == 5 and cut["choices"][0]["prompt_token_ids"] == PROMPT[-5:]
    assert cut["choices"][0]["token_ids"] == given["choices"][0]["token_ids"]
    assert cut["choices"][0]["text"] == tok.decode(PROMPT[-5:]) + given["choices"][0]["text"]  # echo: what ran
    ids = http.post("/tokenize", json={"messages": MSGS}).json()["tokens"]
    chat_cut = chat(http, truncate_prompt_tokens=6, **greedy)
    assert chat_cut["usage"]["prompt_tokens"] == 6 and chat_cut["prompt_token_ids"] == ids[-6:]
    assert chat_cut["choices"][0]["token_ids"] == complete(http, prompt=ids[-6:], **greedy)["choices"][0]["token_ids"]
    streamed = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "truncate_prompt_tokens": 5,
                                                  "stream": True, "stream_options": {"include_usage": True}, **greedy})
    assert '"prompt_tokens":5,' in streamed.text
    assert complete(http, prompt=PROMPT, truncate_prompt_tokens=-1, **greedy)["usage"]["prompt_tokens"] == len(PROMPT)
    for bad in (0, -2):
        assert error(http, "/v1/completions", prompt=PROMPT, truncate_prompt_tokens=bad)["param"] == \
            "truncate_prompt_tokens"


# --- reset_prefix_cache ---------------------------------------------------------------------------
def test_reset_prefix_cache_drops_the_cached_prefixes(http, srv):
    one = dict(max_tokens=2, temperature=0)
    chat(http, **one)
    hit = chat(http, **one)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert hit > 0
    srv.wait_idle()
    r = http.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"reset": True}
    assert chat(http, **one)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert chat(http, **one)["usage"]["prompt_tokens_details"]["cached_tokens"] == hit  # caching goes on


# --- in-process and through agentrt.connect -------------------------------------------------------
def test_the_extras_as_sampling_arguments(tiny_model_path, srv):
    kw = dict(max_tokens=12, temperature=1.0, seed=2, ignore_eos=True, allowed_token_ids=ALLOWED, full=True)
    cut = dict(max_tokens=4, temperature=0, ignore_eos=True, truncate_prompt_tokens=4, bad_words=["the"], full=True)

    async def calls():
        return (await agentrt.generate(PROMPT, **kw), await agentrt.chat(MSGS, **kw),
                await agentrt.generate(PROMPT, **cut), await agentrt.generate(PROMPT[-4:], **cut))

    async def in_process():
        async with agentrt.Runtime(str(tiny_model_path), policy="fcfs", num_blocks=128):
            return await calls()

    async def remote():
        async with agentrt.connect(srv.url):
            return await calls()

    for gen, chatted, truncated, given in (anyio.run(in_process), anyio.run(remote)):
        assert set(gen.choices[0].token_ids) <= set(ALLOWED) and set(chatted.choices[0].token_ids) <= set(ALLOWED)
        assert truncated.usage.prompt_tokens == 4 and truncated.choices[0].token_ids == given.choices[0].token_ids
