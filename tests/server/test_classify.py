"""Sequence classification (vLLM's `LLM.classify` and POST /classify): a *ForSequenceClassification
checkpoint's score head on the last token's final hidden state, softmaxed, equal to HF transformers' on
the same random weights, batched with chunked prefill; a model without the head is refused by name."""

from __future__ import annotations

import os

import httpx
import pytest
import torch

from agentrt.engine import LLM
from agentrt.engine.loader import load_tokenizer, resolve_model
from agentrt.engine.sampling_params import InvalidRequestError
from tests.conftest import assert_all_blocks_free
from tests.server.live import live_server, tiny_config

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TEXTS = ["a great film", "it rained all day and the bus was late again", "ok", "terrible service " * 6]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = load_tokenizer(resolve_model(os.environ.get("AGENTRT_TEST_TOKENIZER")))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, num_labels=3,
                      id2label=LABELS, label2id={v: k for k, v in LABELS.items()}, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = LlamaForSequenceClassification(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    path = tmp_path_factory.mktemp("classifier")
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    return path, hf, tok


def test_probabilities_match_hf(classifier):
    path, hf, tok = classifier
    llm = LLM(str(path), dtype="float32", num_blocks=64, max_num_batched_tokens=24)  # chunked prefill
    outs = llm.classify(TEXTS, progress=False)
    with torch.no_grad():
        for text, out in zip(TEXTS, outs, strict=True):
            ids = tok(text, return_tensors="pt")["input_ids"]
            want = hf(input_ids=ids).logits[0].softmax(-1)
            assert out.probs == pytest.approx(want.tolist(), abs=1e-5)
            assert out.label == LABELS[int(want.argmax())] and out.num_classes == 3
    assert_all_blocks_free(llm.core)


def test_a_model_without_the_head_is_refused(tiny_model_path):
    with pytest.raises(InvalidRequestError, match="no classification head"):
        LLM(str(tiny_model_path), num_blocks=16).classify(["hi"], progress=False)


def test_classify_route(classifier, tiny_model_path):
    path, _, _ = classifier
    want = LLM(str(path), dtype="float32", num_blocks=64).classify(TEXTS, progress=False)
    with live_server(tiny_config(path, served_model_name="clf", engine={"dtype": "float32"})) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http:
        r = http.post("/classify", json={"model": "clf", "input": TEXTS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["model"] == "clf"
        assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
        for d, w in zip(body["data"], want, strict=True):
            assert d["probs"] == pytest.approx(w.probs, abs=1e-6) and d["label"] == w.label and d["num_classes"] == 3
        assert body["usage"]["prompt_tokens"] > 0
        assert http.post("/v1/classify", json={"input": "ok"}).json()["data"][0]["label"] == want[2].label
        r = http.post("/classify", json={"input": []})
        assert r.status_code == 400
    with live_server(tiny_config(tiny_model_path, served_model_name="tiny")) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http:
        r = http.post("/classify", json={"input": "hi"})
        assert r.status_code == 400 and "classification head" in r.json()["error"]["message"]
