"""Layer groups through the whole engine (engine.kv_layout, engine.kv_cache_manager): tiny seeded checkpoints
with Gemma 3's layer rules (five sliding-window layers to one full) and gpt-oss's (alternating, sinks),
windows far shorter than the conversations, so a window group frees blocks all along.

- Greedy tokens identical with prefix caching on, off, and with every block kept (`swa_full`), over a
  multi-turn conversation whose turns hit the cache past many windows.
- An agent loop of 10 calls, each appending the reply and a new tool result: from call 2 on, the tokens served
  from the cache are >= 90% of what the call shares with the previous one, and the last reply equals a cold
  engine's.
- Memory: the blocks a long conversation holds are what its layer rules require (per group), and at one KV
  budget the engine keeps more conversations running at once than with every block kept.
Every block is free after the work."""

from __future__ import annotations

import os

import pytest
import torch

from agentrt.engine import LLM, SamplingParams
from agentrt.engine.loader import load_tokenizer, resolve_model
from tests.conftest import assert_all_blocks_free
from tests.engine.test_moe_models import gpt_oss_config, make_hf

VOCAB = 512
WINDOW = 12


def gemma3_config():
    import transformers as tf

    types = ["sliding_attention"] * 5 + ["full_attention"]
    return tf.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                               rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                               sliding_window=WINDOW, layer_types=types, query_pre_attn_scalar=16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def make(arch):
        if arch not in made:
            path = tmp_path_factory.mktemp(arch)
            cfg = gemma3_config() if arch == "gemma3_text" else gpt_oss_config()
            cfg.max_position_embeddings = 1024
            make_hf(cfg, seed=5).save_pretrained(path)
            load_tokenizer(resolve_model(os.environ.get("AGENTRT_TEST_TOKENIZER"))).save_pretrained(path)
            made[arch] = path
        return made[arch]

    return make


def _tokens(n, seed):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _loop(llm, calls=10, first=40, tool=23, params=GREEDY):
    """An agent loop: each call's prompt is the previous prompt + its reply + a tool result. -> per call
    (prompt, reply, cached tokens)."""
    prompt, out = _tokens(first, 11), []
    for k in range(calls):
        (o,) = llm.generate([{"prompt_token_ids": prompt}], params)
        out.append((prompt, o.token_ids, o.num_cached_tokens))
        prompt = prompt + o.token_ids + _tokens(tool, 100 + k)
    return out


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss"])
def test_agent_loop_hits_the_cache_and_replies_as_a_cold_engine(checkpoint, arch):
    path = checkpoint(arch)
    llm = LLM(str(path), num_blocks=400, block_size=4, max_num_batched_tokens=64)
    groups = llm.core.kv_layout.groups
    assert len(groups) > 1 and any(g.window for g in groups)  # the rules this test is about
    calls = _loop(llm)
    for (prev, reply, _), (prompt, _, cached) in zip(calls, calls[1:]):
        shared = len(prev) + len(reply)  # the reply's last token was sampled, never computed: one block short
        assert prompt[:shared] == prev + reply
        assert cached >= 0.9 * shared - 4, (arch, cached, shared)
    assert_all_blocks_free(llm.core)
    prompt, reply, _ = calls[-1]
    assert len(prompt) > 20 * WINDOW  # many windows past the start
    for cold in (LLM(str(path), num_blocks=400, block_size=4, enable_prefix_caching=False),
                 LLM(str(path), num_blocks=400, block_size=4, swa_full=True)):
        (o,) = cold.generate([{"prompt_token_ids": prompt}], GREEDY)
        assert o.token_ids == reply, arch


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss"])
def test_greedy_equal_with_cache_on_off_and_all_blocks_kept(checkpoint, arch):
    """Several conversations at once, chunked prefill, multi-step decode: the same tokens whichever way."""
    path = checkpoint(arch)
    replies = []
    for kw in ({}, {"enable_prefix_caching": False}, {"swa_full": True}, {"num_scheduler_steps": 4}):
        llm = LLM(str(path), num_blocks=300, block_size=4, max_num_batched_tokens=32, max_num_seqs=3, **kw)
        convs = [_tokens(30 + 7 * i, i) for i in range(3)]
        got = []
        for _turn in range(3):
            outs = llm.generate([{"prompt_token_ids": c} for c in convs], GREEDY)
            got.append([o.token_ids for o in outs])
            convs = [c + o.token_ids + _tokens(9, len(c)) for c, o in zip(convs, outs)]
        assert_all_blocks_free(llm.core)
        replies.append(got)
    assert replies[1] == replies[0] and replies[2] == replies[0] and replies[3] == replies[0]


def test_long_conversation_holds_what_its_layer_rules_need(checkpoint):
    """Gemma 3's rules at 4-token blocks and a 12-position window: a running 600-token conversation holds its
    full group's 150 blocks and per window group 4 + 1; with swa_full, every layer's 150."""
    path = checkpoint("gemma3_text")
    prompt = _tokens(600, 3)
    held = {}
    for kw in ({}, {"swa_full": True}):
        llm = LLM(str(path), num_blocks=2000, block_size=4, max_num_batched_tokens=128, **kw)
        core = llm.core
        seen = []
        core.on_schedule = lambda out, core=core, seen=seen: seen.append(core.kv.num_blocks - core.kv.num_free_blocks)
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        pages = seen[-1] * core.kv_layout.page_layers  # block-layers held at the last step
        held[bool(kw)] = pages
        assert_all_blocks_free(core)
    # the last step computes position 600: 151 blocks of one full layer; a window layer sees 589..600, blocks
    # 147..150; with swa_full, six layers' 151 blocks
    assert held[True] == 151 * 6, held
    assert held[False] == 151 + 5 * 4
    rule = 601 + 5 * WINDOW  # positions the layer rules keep (one full layer, five of the window)
    assert held[False] * 4 <= 1.1 * rule
