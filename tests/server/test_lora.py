"""LoRA adapters over HTTP, as vLLM serves them: `--lora-modules name=path`, a request naming an adapter
as its model (chat, completions, embeddings, Anthropic's messages, the Responses API), /v1/models listing
adapters with their parent, and runtime loading and unloading; tokens equal the in-process engine's with
the same adapter. And in-process: `Runtime(lora_modules=...)`, `agentrt.chat(..., model=name)`."""

from __future__ import annotations

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoConfig

import agentrt
from agentrt._errors import ConfigError, InvalidCallError
from agentrt.engine import LLM, LoRARequest, SamplingParams
from agentrt.engine.testing import make_lora_adapter
from tests.conftest import assert_all_blocks_free
from tests.server.conftest import check_idle
from tests.server.live import live_server, tiny_config

PROMPT = [17, 2000, 345, 9001, 42, 7, 88, 1234, 555, 31000, 12, 9, 400, 22, 5000, 61, 70]  # over a block


@pytest.fixture(scope="module")
def adapters(tiny_model_path, tmp_path_factory):
    cfg = AutoConfig.from_pretrained(tiny_model_path)
    root = tmp_path_factory.mktemp("adapters")
    return {"sql": make_lora_adapter(root / "sql", cfg, rank=8, alpha=16, seed=1),
            "qv": make_lora_adapter(root / "qv", cfg, rank=4, alpha=8, targets=("q_proj", "v_proj"), seed=2, std=0.2)}


@pytest.fixture(scope="module")
def srv(tiny_model_path, adapters):
    config = tiny_config(tiny_model_path, served_model_name="tiny", lora_modules=[f"sql={adapters['sql']}"],
                         allow_runtime_lora_updating=True, engine={"dtype": "float32"})
    with live_server(config) as s:
        yield s
        check_idle(s)


@pytest.fixture(scope="module")
def expected(tiny_model_path, adapters):
    """Greedy tokens of PROMPT in-process: the base model, and each adapter."""
    llm = LLM(str(tiny_model_path), dtype="float32", num_blocks=32, enable_lora=True)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    out = {name: llm.generate([PROMPT], sp, lora_request=LoRARequest(name, i, str(path)), progress=False)
           for i, (name, path) in enumerate(adapters.items(), start=1)}
    out["base"] = llm.generate([PROMPT], sp, progress=False)
    assert_all_blocks_free(llm.core)
    return {k: v[0].outputs[0].token_ids for k, v in out.items()}


def _complete(http, model, **kw):
    r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                           "ignore_eos": True, "return_token_ids": True, **kw})
    return r


def test_models_lists_adapters_with_their_parent(http, adapters):
    data = http.get("/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [("tiny", None), ("sql", "tiny")]
    assert data[1]["root"] == str(adapters["sql"])
    assert http.get("/v1/models/sql").json()["parent"] == "tiny"


def test_an_adapter_named_as_the_model_serves_its_tokens(http, client, expected):
    assert expected["sql"] != expected["base"]
    r = _complete(http, "sql")
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "sql" and r.json()["choices"][0]["token_ids"] == expected["sql"]
    r = _complete(http, "tiny")
    assert r.json()["model"] == "tiny" and r.json()["choices"][0]["token_ids"] == expected["base"]
    # the OpenAI SDK, streaming: the chunks name the adapter and spell its tokens
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="sql", prompt=PROMPT, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True})
        if c.choices and c.model == "sql")
    assert text == http.post("/detokenize", json={"tokens": expected["sql"]}).json()["prompt"]


def test_every_api_takes_an_adapter(http, client):
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.model == "sql"
    base = client.embeddings.create(model="tiny", input="a sentence").data[0].embedding
    tuned = client.embeddings.create(model="sql", input="a sentence")
    assert tuned.model == "sql" and tuned.data[0].embedding != base
    r = http.post("/v1/messages", json={"model": "sql", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["model"] == "sql"
    r = http.post("/v1/responses", json={"model": "sql", "input": "hi", "max_output_tokens": 4})
    assert r.status_code == 200 and r.json()["model"] == "sql"
    http.delete(f"/v1/programs/{r.headers['x-program-id']}")  # a response chain's program holds its prefix


def test_unknown_model_is_404_naming_the_adapters(http):
    r = _complete(http, "nope")
    assert r.status_code == 404
    assert "'nope'" in r.json()["error"]["message"] and "'sql'" in r.json()["error"]["message"]


def test_load_and_unload_at_run_time(http, srv, adapters, expected, tmp_path):
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": str(adapters["qv"])})
    assert r.status_code == 200 and "qv" in r.text
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny", "sql", "qv"]
    assert _complete(http, "qv").json()["choices"][0]["token_ids"] == expected["qv"]
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": str(adapters["qv"])})
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    bad = str(tmp_path / "missing")
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": bad})
    assert r.status_code == 400 and bad in r.json()["error"]["message"]
    assert "bad" not in [m["id"] for m in http.get("/v1/models").json()["data"]]  # nothing left behind
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "qv"})
    assert r.status_code == 200
    assert _complete(http, "qv").status_code == 404
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "qv"}).status_code == 404
    # loaded again under the same name: served again (a new id, so none of the old K/V is reused)
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": str(adapters["qv"])}).status_code == 200
    assert _complete(http, "qv").json()["choices"][0]["token_ids"] == expected["qv"]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "qv"}).status_code == 200
    srv.state.config.allow_runtime_lora_updating = False
    try:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": str(adapters["qv"])})
        assert r.status_code == 404 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]
    finally:
        srv.state.config.allow_runtime_lora_updating = True


def _lora_info(http) -> list[dict[str, str]]:
    body = http.get("/metrics").text
    return [s.labels for f in text_string_to_metric_families(body) if f.name == "agentrt:lora_requests_info"
            for s in f.samples]


def test_metrics_name_the_adapters_in_use(http, srv):
    """vLLM's lora_requests_info: while an adapter's request runs its name is a label; once it ends, the one
    series left has empty adapter labels."""
    body = {"model": "sql", "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a dropped iterator closes the connection, which aborts the call
        next(line for line in lines if line.startswith("data: "))  # running: a token came
        assert _lora_info(http) == [{"max_lora": "8", "running_lora_adapters": "sql", "waiting_lora_adapters": ""}]
    srv.wait_idle()  # the closed stream aborted the call
    assert _lora_info(http) == [{"max_lora": "8", "running_lora_adapters": "", "waiting_lora_adapters": ""}]


def test_bad_lora_modules_fail_before_the_model_loads(tmp_path):
    from agentrt.server import ServerConfig

    with pytest.raises(ValueError, match="no adapter_config.json"):
        ServerConfig(lora_modules=[f"x={tmp_path}"])
    with pytest.raises(ValueError, match="name=path"):
        ServerConfig(lora_modules=["just-a-path"])


def test_programs_name_adapters_in_process(tiny_model_path, adapters, expected):
    anyio.run(_in_process, tiny_model_path, adapters, expected)


async def _in_process(tiny_model_path, adapters, expected):
    async with agentrt.Runtime(str(tiny_model_path), lora_modules={"sql": str(adapters["sql"])}, dtype="float32",
                               num_blocks=64) as rt:
        sp = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "full": True}
        got = await agentrt.generate(PROMPT, model="sql", **sp)
        assert got.choices[0].token_ids == expected["sql"]
        assert (await agentrt.generate(PROMPT, **sp)).choices[0].token_ids == expected["base"]
        with pytest.raises(InvalidCallError, match="'other'"):
            await agentrt.generate(PROMPT, model="other", **sp)
        await rt.load_lora_adapter("qv", str(adapters["qv"]))
        assert (await agentrt.generate(PROMPT, model="qv", **sp)).choices[0].token_ids == expected["qv"]
        rt.unload_lora_adapter("qv")
        assert_all_blocks_free(rt.engine.core)
    with pytest.raises(ConfigError, match="not a directory"):
        async with agentrt.Runtime(str(tiny_model_path), lora_modules={"x": "/no/such/dir"}, num_blocks=16):
            pass
