"""`LLM.chat` as vLLM has it, `LLM(...)` and `AsyncEngine(...)` with the same arguments, the progress
bar over long `LLM.generate` calls, and the converted-model cache keyed by content, not path."""

import io
import shutil

import anyio
import pytest
import torch

from agentrt.engine import LLM, AsyncEngine, EngineConfig, SamplingParams, loader
from agentrt.engine import llm as llm_mod
from agentrt.engine.sampling_params import InvalidRequestError

KW = dict(num_blocks=64, block_size=4)
CONV = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(str(tiny_model_path), **KW)


def test_chat_renders_the_template_like_generate(llm):
    p = SamplingParams(max_tokens=5, temperature=0)
    text = llm.tokenizer.apply_chat_template(CONV, tokenize=False, add_generation_prompt=True)
    want = llm.generate([llm.tokenizer(text, add_special_tokens=False)["input_ids"]], p)[0]
    one = llm.chat(CONV, p)
    many = llm.chat([CONV, CONV + [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]], p)
    assert len(one) == 1 and one[0].token_ids == want.token_ids
    assert len(many) == 2 and many[0].token_ids == want.token_ids
    assert many[1].prompt_token_ids != many[0].prompt_token_ids
    with pytest.raises(InvalidRequestError, match="conversation 1 must be"):
        llm.chat([CONV, "hello"], p)


def test_chat_continues_a_final_message_and_passes_template_variables(llm):
    """vLLM's LLM.chat options: continue_final_message leaves the last assistant message open (the same
    tokens as its rendering by the tokenizer), chat_template_kwargs reach the template."""
    p = SamplingParams(max_tokens=4, temperature=0)
    prefill = [*CONV, {"role": "assistant", "content": "Well, the answer is"}]
    (out,) = llm.chat(prefill, p, add_generation_prompt=False, continue_final_message=True)
    text = llm.tokenizer.apply_chat_template(prefill, tokenize=False, continue_final_message=True)
    assert text.endswith("the answer is")
    assert out.prompt_token_ids == llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    template = "{{ prefix }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (out,) = llm.chat(CONV, p, chat_template=template, chat_template_kwargs={"prefix": "Note: "})
    assert llm.tokenizer.decode(out.prompt_token_ids) == "Note: " + "".join(m["content"] for m in CONV)
    for kw, match in (({"continue_final_message": True}, "cannot both be true"),
                      ({"continue_final_message": True, "add_generation_prompt": False, "conversations": CONV},
                       "role is 'user'"),
                      ({"chat_template_kwargs": {"tokenize": True}}, "may not set 'tokenize'")):
        with pytest.raises(InvalidRequestError, match=match):
            llm.chat(**{"conversations": prefill, "params": p, **kw})


def test_llm_and_async_engine_take_the_same_arguments(tiny_model_path):
    cfg = EngineConfig(model=str(tiny_model_path), **KW)

    async def main():
        for engine in (AsyncEngine(str(tiny_model_path), **KW), AsyncEngine(cfg), AsyncEngine(model=str(tiny_model_path))):
            async with engine:
                out = await engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0)).result()
                assert len(out.token_ids) == 3
        return out.token_ids

    got = anyio.run(main)
    assert LLM(cfg).generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))[0].token_ids == got
    with pytest.raises(TypeError, match="not both"):
        AsyncEngine(cfg, num_blocks=3)
    with pytest.raises(TypeError, match="not both"):
        LLM(cfg, num_blocks=3)


def test_progress_bar_over_generate(llm, monkeypatch):
    from rich.console import Console

    buf = io.StringIO()
    monkeypatch.setattr("rich.console.Console", lambda **kw: Console(file=buf, force_terminal=False, width=100))
    outs = llm.generate([[1, 2, 3]] * 10, SamplingParams(max_tokens=2), progress=True)
    assert len(outs) == 10 and "10/10" in buf.getvalue()
    buf.truncate(0)
    llm.generate([[1, 2, 3]] * 10, SamplingParams(max_tokens=2), progress=False)
    assert buf.getvalue() == ""
    with pytest.raises(InvalidRequestError, match="progress must be"):
        llm.generate([[1, 2, 3]], progress="yes")
    assert llm_mod.PROGRESS_MIN_PROMPTS > 1  # "auto" stays quiet for a handful of prompts


def test_converted_model_cache_is_keyed_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRT_CACHE_DIR", str(tmp_path / "cache"))
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8).numpy().tobytes()
    a, b = tmp_path / "venv-a" / "m.gguf", tmp_path / "checkout-b" / "m.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(data)
    assert loader.converted_path(a, "m") == loader.converted_path(b, "m")
    shutil.copy(a, tmp_path / "copy.gguf")
    assert loader.converted_path(tmp_path / "copy.gguf", "m") == loader.converted_path(a, "m")
    changed = bytearray(data)
    changed[-1] ^= 1
    b.write_bytes(bytes(changed))
    assert loader.converted_path(b, "m") != loader.converted_path(a, "m")
    done = loader.converted_path(a, "copy")  # a converted copy is found from any path, without converting
    done.mkdir(parents=True)
    (done / "config.json").write_text("{}")
    monkeypatch.setattr(loader, "_write_checkpoint", lambda *a: pytest.fail("converted again"))
    assert loader.resolve_model(tmp_path / "copy.gguf") == done


def test_generate_takes_vllm_prompt_dicts(llm):
    """vLLM's TokensPrompt / TextPrompt dicts, alone or in a list beside plain prompts: the same outputs as
    the token ids or text they hold; a dict with other keys is refused, naming them."""
    ids = llm.tokenizer.encode("The capital of France is")
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    want = llm.generate([ids, "Once upon a time"], params)
    got = llm.generate([{"prompt_token_ids": ids}, {"prompt": "Once upon a time"}], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert got[0].prompt_token_ids == ids
    one = llm.generate({"prompt_token_ids": ids}, params)
    assert len(one) == 1 and one[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="multi_modal_data"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {}}, params)
