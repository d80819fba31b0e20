"""`POST /v1/embeddings` on the tiny model: OpenAI's SDK and LangChain's `OpenAIEmbeddings` unchanged,
vectors against HF's base model, vLLM's extras, bad input, and the calls kept in their program."""

import base64

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()


@torch.no_grad()
def expected(hf, ids, dims=None):
    v = hf(torch.tensor([ids])).last_hidden_state[0, -1].double()
    v = v[:dims] if dims else v
    return (v / v.norm()).numpy()


def test_openai_sdk_matches_hf(client, tok, hf):
    texts = ["The quick brown fox", "jumps over the lazy dog again and again"]
    r = client.embeddings.create(model="tiny", input=texts)  # the SDK asks for base64 and decodes it
    assert [d.index for d in r.data] == [0, 1] and r.model == "tiny"
    ids = [tok(t)["input_ids"] for t in texts]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    for d, i in zip(r.data, ids, strict=True):
        np.testing.assert_allclose(d.embedding, expected(hf, i), rtol=1e-4, atol=1e-5)


def test_float_and_base64_agree(http):
    body = {"model": "tiny", "input": [[11, 12, 13, 14], [7, 8]]}
    f = http.post("/v1/embeddings", json=body).json()
    b = http.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    assert f["object"] == "list" and f["data"][0]["object"] == "embedding"
    for x, y in zip(f["data"], b["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(y["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.asarray(x["embedding"], dtype="<f4"))
        assert len(decoded) == 64


def test_dimensions_normalize_truncate(http, hf):
    ids = list(range(200, 230))
    r = http.post("/v1/embeddings", json={"input": ids, "dimensions": 8}).json()
    np.testing.assert_allclose(r["data"][0]["embedding"], expected(hf, ids, 8), rtol=1e-4, atol=1e-5)
    raw = http.post("/v1/embeddings", json={"input": ids, "normalize": False}).json()["data"][0]["embedding"]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).last_hidden_state[0, -1].numpy()
    np.testing.assert_allclose(raw, want, rtol=1e-4, atol=1e-4)
    cut = http.post("/v1/embeddings", json={"input": [ids, ids[:5]], "truncate_prompt_tokens": 3}).json()
    assert cut["usage"]["prompt_tokens"] == 6
    np.testing.assert_allclose(cut["data"][0]["embedding"], expected(hf, ids[-3:]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("body, param, match", [
    ({"input": []}, "input", "input must be"),
    ({"input": ["a", [1, 2]]}, "input", "input must be"),
    ({"input": [[]]}, "input", "input must be"),
    ({"input": "hi", "dimensions": 65}, "dimensions", "over the model's hidden size 64"),
    ({"input": "hi", "dimensions": 0}, "dimensions", ""),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", ""),
    ({"input": [10**9]}, "input", ""),
])
def test_bad_requests_name_the_field(http, body, param, match):
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and match in err["message"]


def test_calls_belong_to_the_program(http):
    r = http.post("/v1/embeddings", json={"input": ["one", "two", "three"]}, headers={"X-Program-Id": "rag-1"})
    assert r.status_code == 200 and r.headers["X-Program-Id"] == "rag-1" and r.json()["program_id"] == "rag-1"
    prog = http.get("/v1/programs/rag-1").json()
    assert prog["calls_done"] == 3 and prog["num_prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert prog["num_output_tokens"] == 0 and prog["service_s"] > 0
    http.delete("/v1/programs/rag-1")


def test_langchain_openai_embeddings(srv):
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: LangChain would otherwise count tokens with tiktoken (a download)
    emb = OpenAIEmbeddings(model="tiny", base_url=srv.url + "/v1", api_key="x", check_embedding_ctx_length=False)
    docs = emb.embed_documents(["alpha beta", "gamma"])
    query = emb.embed_query("alpha beta")
    assert len(docs) == 2 and len(docs[0]) == 64
    np.testing.assert_allclose(docs[0], query, rtol=1e-6)
    assert abs(np.linalg.norm(docs[1]) - 1) < 1e-5


def test_agentrt_embed_in_process_and_through_connect(srv, tiny_model_path, hf, tok):
    """The same program embeds in-process and against the server: the same vectors (HF's), one call per
    input in the program's record either way, and bad input named before anything runs."""
    import anyio

    import agentrt

    @agentrt.program
    async def rag(docs, query):
        vectors = await agentrt.embed(docs, dimensions=16)
        one = await agentrt.embed(query)
        with pytest.raises(agentrt.InvalidCallError, match="embed inputs must be"):
            await agentrt.embed([])
        return vectors, one, agentrt.current_program_id()

    docs, query = ["red apples", "green pears and more"], [5, 6, 7, 8]

    async def in_process():
        async with agentrt.Runtime(str(tiny_model_path), num_blocks=64) as rt:
            vectors, one, pid = await rag(docs, query)
            return vectors, one, rt.programs[pid].calls_done

    async def remote():
        async with agentrt.connect(srv.url):
            vectors, one, pid = await rag(docs, query)
        return vectors, one, srv.state.runtime.programs[pid].calls_done

    local, far = anyio.run(in_process), anyio.run(remote)
    assert local[2] == far[2] == 3
    for got in (local, far):
        vectors, one, _ = got
        assert len(vectors) == 2 and all(len(v) == 16 for v in vectors)
        for v, text in zip(vectors, docs, strict=True):
            np.testing.assert_allclose(v, expected(hf, tok(text)["input_ids"], 16), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(one, expected(hf, query), rtol=1e-4, atol=1e-5)


def test_server_pooling_flag(tiny_model_path, hf):
    """`--pooling mean` pools every row; an unknown method is refused before the model loads."""
    import httpx

    from agentrt.server.config import ServerConfig
    from tests.server.conftest import check_idle
    from tests.server.live import live_server, tiny_config

    with pytest.raises(ValueError, match="pooling must be one of last, mean, cls, got 'max'"):
        ServerConfig(pooling="max")
    with pytest.raises(ValueError, match="max_embedding_inputs must be an integer >= 1"):
        ServerConfig(max_embedding_inputs=0)
    ids = list(range(50, 70))
    with live_server(tiny_config(tiny_model_path, pooling="mean", max_embedding_inputs=2)) as s:
        with httpx.Client(base_url=s.url, timeout=60) as h:
            v = h.post("/v1/embeddings", json={"input": ids, "normalize": False}).json()["data"][0]["embedding"]
            over = h.post("/v1/embeddings", json={"input": ["a", "b", "c"]})
        check_idle(s)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).last_hidden_state[0].mean(0).numpy()
    np.testing.assert_allclose(v, want, rtol=1e-4, atol=1e-4)
    assert over.status_code == 400 and "--max-embedding-inputs" in over.json()["error"]["message"]


def test_score_and_rerank_are_cosines_of_the_embeddings(http):
    """vLLM's /score (one text against many, or pairs) and /rerank (Jina / Cohere shape, best first, top_n)
    give the cosine similarity of the inputs' embeddings, at every path vLLM serves them."""
    query, docs = "red apples", ["green pears", "red apples and more", "a blue car"]
    vec = {d["index"]: np.asarray(d["embedding"]) for d in
           http.post("/v1/embeddings", json={"input": [query, *docs]}).json()["data"]}
    want = [float(vec[0] @ vec[i + 1]) for i in range(3)]
    for path in ("/score", "/v1/score"):
        r = http.post(path, json={"text_1": query, "text_2": docs}).json()
        assert [d["index"] for d in r["data"]] == [0, 1, 2] and r["data"][0]["object"] == "score"
        np.testing.assert_allclose([d["score"] for d in r["data"]], want, rtol=1e-5, atol=1e-6)
    pairs = http.post("/score", json={"text_1": [query, docs[0]], "text_2": [docs[1], docs[0]]}).json()["data"]
    np.testing.assert_allclose([d["score"] for d in pairs], [want[1], 1.0], rtol=1e-5, atol=1e-5)
    order = sorted(range(3), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = http.post(path, json={"query": query, "documents": docs, "top_n": 2}).json()
        assert [x["index"] for x in r["results"]] == order[:2]
        assert [x["document"]["text"] for x in r["results"]] == [docs[i] for i in order[:2]]
        np.testing.assert_allclose([x["relevance_score"] for x in r["results"]], [want[i] for i in order[:2]],
                                   rtol=1e-5, atol=1e-6)
        assert r["usage"]["total_tokens"] > 0
    bare = http.post("/rerank", json={"query": query, "documents": docs, "return_documents": False}).json()
    assert len(bare["results"]) == 3 and bare["results"][0].get("document") is None


@pytest.mark.parametrize("path, body, param", [
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/rerank", {"query": "", "documents": ["a"]}, "query"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
    ("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
])
def test_bad_score_and_rerank_requests(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
