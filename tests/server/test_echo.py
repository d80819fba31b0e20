"""`echo` on /v1/completions, as vLLM and OpenAI's legacy API have it: each choice's text starts with its
prompt, and with `logprobs` its log-probs start with the prompt's (the first token's None). With
`max_tokens=0` nothing is generated: the prompt is only scored, which is how evaluation harnesses
(lm-evaluation-harness's `local-completions`) compute log-likelihoods. Checked against HF transformers'
log-softmax on the same weights, streamed and not, text and token-id prompts."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def hf_logp(tiny_model_path):
    """Prompt token ids -> [len, vocab] log-softmax rows of HF transformers on the same weights."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)

    def logp(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return logp


def test_echo_scores_the_prompt_like_hf(client, tok, hf_logp):
    ids = tok(PROMPT)["input_ids"]
    r = client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=3, max_tokens=0)
    (c,) = r.choices
    assert c.text == PROMPT and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    rows = hf_logp(ids)
    want = [rows[i - 1, t].item() for i, t in enumerate(ids) if i]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-3)
    for i in range(1, len(ids)):
        best = rows[i - 1].topk(3)
        assert list(lp.top_logprobs[i]) == [tok.decode([t]) for t in best.indices.tolist()]
        assert list(lp.top_logprobs[i].values()) == pytest.approx(best.values.tolist(), abs=1e-3)
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert lp.text_offset == offsets


def test_echo_then_generated_text_and_logprobs(client, tok, hf_logp):
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1, echo=True)
    (c,), (p,) = r.choices, plain.choices
    ids = tok(PROMPT)["input_ids"]
    assert c.text == PROMPT + p.text and c.finish_reason == p.finish_reason
    lp = c.logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids] + p.logprobs.tokens
    assert lp.token_logprobs[len(ids):] == pytest.approx(p.logprobs.token_logprobs, abs=1e-5)
    assert lp.top_logprobs[len(ids):] == p.logprobs.top_logprobs
    assert lp.text_offset[len(ids):] == [len(PROMPT) + o for o in p.logprobs.text_offset]
    assert r.usage.completion_tokens == plain.usage.completion_tokens == 5
    # without logprobs: the text only
    bare = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert bare.choices[0].text == c.text and bare.choices[0].logprobs is None


def test_lm_eval_style_batch_of_token_id_prompts(srv, tok, hf_logp):
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs=1, max_tokens=1, temperature 0;
    it reads token_logprobs[ctxlen:-1] and checks greedy-ness against top_logprobs."""
    pairs = [("Question: what is 2 + 2? Answer:", " 4"), ("The sky is", " blue"), ("Water boils at", " 100 degrees")]
    prompts = [tok(a)["input_ids"] + tok(b)["input_ids"] for a, b in pairs]
    body = {"model": "tiny", "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234}
    out = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    for (ctx, cont), ids, choice in zip(pairs, prompts, out["choices"]):
        ctxlen = len(tok(ctx)["input_ids"])
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        rows = hf_logp(ids)
        assert len(lps) == len(ids) - ctxlen
        assert sum(lps) == pytest.approx(sum(rows[i - 1, ids[i]].item() for i in range(ctxlen, len(ids))), abs=1e-3)
        greedy = all(max(top, key=top.get) == tok.decode([ids[ctxlen + j]]) for j, top in enumerate(tops))
        assert greedy == all(rows[i - 1].argmax().item() == ids[i] for i in range(ctxlen, len(ids)))


def test_streamed_echo_is_the_same(srv, client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True)
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0] == PROMPT and "".join(texts) == whole.text
    first = chunks[0].choices[0].logprobs
    n = len(first.tokens)
    assert first.token_logprobs[0] is None and first.token_logprobs[1:] == pytest.approx(whole.logprobs.token_logprobs[1:n], abs=1e-5)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason
    # max_tokens=0 streamed: the prompt, then the finish
    with httpx.stream("POST", srv.url + "/v1/completions", json={**kw, "max_tokens": 0, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [(e["choices"][0]["text"], e["choices"][0]["finish_reason"]) for e in events] == [(PROMPT, None), ("", "length")]


def test_max_tokens_zero_needs_echo(srv):
    r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "echo" in err["message"]


def test_echo_with_n_gives_every_choice_its_prompt(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=3, temperature=1.0, seed=7, n=2, logprobs=1, echo=True)
    whole = client.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1]
    for c in whole.choices:
        assert c.text.startswith(PROMPT) and c.logprobs.token_logprobs[0] is None
        assert c.logprobs.token_logprobs[1:5] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1:5])
    streamed = {0: "", 1: ""}
    firsts = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.index not in firsts:
                firsts[c.index] = c  # the fork's first chunk: its prompt, with the parent's prompt log-probs
            streamed[c.index] += c.text
    assert all(firsts[i].text == PROMPT and firsts[i].logprobs.token_logprobs[0] is None for i in (0, 1))
    assert firsts[1].logprobs.token_logprobs == pytest.approx(firsts[0].logprobs.token_logprobs[: len(firsts[1].logprobs.token_logprobs)])
    assert [streamed[i] for i in (0, 1)] == [c.text for c in whole.choices]  # a seed: the same draws


def check_prompt_logprobs(entries: list, ids: list[int], rows: torch.Tensor, k: int, tok) -> None:
    """vLLM's prompt_logprobs against HF: per position its own token and the k most likely ones, each with
    its log-prob, rank (1 + how many tokens are more likely) and text."""
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        row, own = rows[i - 1], ids[i]
        best = row.topk(k).indices.tolist() if k else []
        assert set(entries[i]) == {str(t) for t in [own, *best]}
        for t in [own, *best]:
            e = entries[i][str(t)]
            assert e["logprob"] == pytest.approx(row[t].item(), abs=1e-3)
            assert e["decoded_token"] == tok.decode([t])
            lo, hi = 1 + int((row > row[t] + 1e-4).sum()), int((row > row[t] - 1e-4).sum())  # t itself in hi
            assert lo <= e["rank"] <= hi  # exact up to near-ties (engine and HF differ by float noise)
        assert entries[i][str(best[0] if best else own)]["rank"] == (1 if best else entries[i][str(own)]["rank"])


@pytest.mark.parametrize("k", [0, 2])
def test_prompt_logprobs_of_a_completion_like_hf(srv, tok, hf_logp, k):
    """vLLM's `prompt_logprobs` field: with or without generating, with echo and logprobs of another size."""
    ids = tok(PROMPT)["input_ids"]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": k}
    out = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
    (c,) = out["choices"]
    check_prompt_logprobs(c["prompt_logprobs"], ids, hf_logp(ids), k, tok)
    assert c["logprobs"] is None and not c["text"].startswith(PROMPT)
    # with echo + logprobs=1 beside prompt_logprobs=k: each keeps its own size
    out = httpx.post(srv.url + "/v1/completions", json={**body, "echo": True, "logprobs": 1}, timeout=60).json()
    (c,) = out["choices"]
    check_prompt_logprobs(c["prompt_logprobs"], ids, hf_logp(ids), k, tok)
    assert all(t is None or len(t) == 1 for t in c["logprobs"]["top_logprobs"])
    assert httpx.post(srv.url + "/v1/completions", json={**body, "prompt_logprobs": None}).json()["choices"][0][
        "prompt_logprobs"] is None


def test_prompt_logprobs_of_a_chat(srv, client, tok, hf_logp):
    messages = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 1})
    ids = httpx.post(srv.url + "/tokenize", json={"model": "tiny", "messages": messages}).json()["tokens"]
    check_prompt_logprobs(r.model_extra["prompt_logprobs"], ids, hf_logp(ids), 1, tok)
    assert r.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("extra", "why"), [({"stream": True}, "streaming"), ({"prompt_logprobs": 21}, "20"),
                                            ({"prompt_logprobs": -1}, "0")])
def test_prompt_logprobs_refused(srv, path, extra, why):
    body = {"model": "tiny", "max_tokens": 2, "prompt_logprobs": 1, **extra}
    body.update({"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt_logprobs" and why in err["message"]
