"""Prefix caching on the real default model: the cache changes what is computed, never the tokens.

Each scenario runs on two engines, prefix caching on and off, and compares token ids: multi-turn
chats sharing a system prompt (hits across calls, dedup of a prefix computed concurrently), forks
(n > 1 with seeds; greedy forks dedup their identical blocks) and a KV budget small enough to
preempt (the preempted request resumes from its cached blocks).
"""

import pytest
import torch

from agentrt.engine import LLM, SamplingParams
from agentrt.engine.loader import load_tokenizer
from tests.conftest import assert_all_blocks_free, requires_default_model

pytestmark = [requires_default_model, pytest.mark.slow]

BS = 16
SYSTEM = (
    "You are the support assistant of Brick & Bolt, a hardware store. It sells tools, paint and "
    "lumber, rents ladders by the day, and opens nine to six on weekdays. Answer in one sentence."
)
QUESTIONS = [
    ["Are you open on Sunday?", "And on Saturday?", "Thanks. Can I rent a ladder?"],
    ["Do you sell paint?", "Which colours?", "Great, see you tomorrow."],
]
GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The 2 cores are shared with other test runs; two OpenMP threads spin-waiting on each other
    then run these many small steps 5-8x slower than one thread (unless OMP_WAIT_POLICY=PASSIVE)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok(default_model_path):
    return load_tokenizer(default_model_path)


@pytest.fixture(scope="module")
def llms(default_model_path):
    """Caching on and off, same budget (96 blocks: nothing is evicted in these scenarios)."""
    return {on: LLM(str(default_model_path), enable_prefix_caching=on, num_blocks=96, block_size=BS)
            for on in (True, False)}


def chat_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text)["input_ids"]


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def expected_hit(prompt, computed_before) -> int:
    """Longest prefix of `prompt` computed by an earlier call, in whole blocks, last token excluded."""
    best = max((common_prefix(prompt, s) for s in computed_before), default=0)
    return min(best, len(prompt) - 1) // BS * BS


def test_multi_turn_chat_same_tokens_with_hits_and_dedup(llms, tok):
    convs = [[{"role": "system", "content": SYSTEM}] for _ in QUESTIONS]
    computed: list[list[int]] = []  # every sequence whose KV an earlier turn computed
    for turn in range(len(QUESTIONS[0])):
        for conv, qs in zip(convs, QUESTIONS):
            conv.append({"role": "user", "content": qs[turn]})
        prompts = [chat_ids(tok, c) for c in convs]
        before = {on: llm.kv_stats() for on, llm in llms.items()}
        outs = {on: llm.generate(prompts, GREEDY) for on, llm in llms.items()}
        after = {on: llm.kv_stats() for on, llm in llms.items()}

        assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]], f"turn {turn}"
        hits = [o.metrics.num_prefix_hit_tokens for o in outs[True]]
        assert after[True].prefix_hit_tokens - before[True].prefix_hit_tokens == sum(hits)
        assert after[False].prefix_hit_tokens == after[False].dedup_merges == 0
        if turn == 0:
            # both arrive together: the second waits one step for the shared system prompt's blocks, which
            # the first computes, and reads them from the cache (in-batch prefix sharing): computed once,
            # nothing left to merge
            shared = common_prefix(prompts[0], prompts[1]) // BS
            assert shared >= 3
            assert hits == [0, shared * BS]
            assert after[True].dedup_merges == before[True].dedup_merges
        else:  # the chat template is prefix-stable: the whole previous prompt comes from the cache
            assert hits == [expected_hit(p, computed) for p in prompts], f"turn {turn}"
            assert all(h >= len(prev) // BS * BS for h, prev in zip(hits, prev_prompts)), f"turn {turn}"
        prev_prompts = prompts
        for llm in llms.values():
            assert_all_blocks_free(llm.core)

        computed += [p + o.token_ids[:-1] for p, o in zip(prompts, outs[True])]
        for conv, o in zip(convs, outs[True]):
            conv.append({"role": "assistant", "content": o.text})


def test_seeded_forks_same_tokens_and_copy_on_write(llms, tok):
    prompt = chat_ids(tok, [{"role": "user", "content": "Write a haiku about rain on a tin roof."}])
    assert len(prompt) % BS, "the prompt must end inside a block for copy-on-write"
    params = SamplingParams(n=3, temperature=0.8, seed=1234, max_tokens=8, ignore_eos=True)
    outs, cow = {}, {}
    for on, llm in llms.items():
        before = llm.kv_stats().cow_copies
        (out,) = llm.generate([prompt], params)
        outs[on] = [c.token_ids for c in out.outputs]
        cow[on] = llm.kv_stats().cow_copies - before
        assert_all_blocks_free(llm.core)
    assert outs[True] == outs[False]
    assert [len(t) for t in outs[True]] == [8, 8, 8]
    assert len({tuple(t) for t in outs[True]}) > 1, "three seeded samples should not all agree"
    # parent and first child copy the shared partial block; the last holder writes in place
    assert cow == {True: 2, False: 2}


def test_greedy_forks_are_identical_and_their_blocks_merge(llms, tok):
    prompt = chat_ids(tok, [{"role": "user", "content": "Name three colours of paint."}])
    fill = BS - len(prompt) % BS  # decode steps until the prompt's last block is full
    assert 0 < fill < BS, "the prompt must end inside a block for copy-on-write"
    params = SamplingParams(n=3, temperature=0, max_tokens=fill + 2, ignore_eos=True)
    results = {}
    for on, llm in llms.items():
        before = llm.kv_stats()
        (out,) = llm.generate([prompt], params)
        after = llm.kv_stats()
        results[on] = [c.token_ids for c in out.outputs]
        assert after.cow_copies - before.cow_copies == 2
        # the three copies of that block fill identically: with caching, two are merged into one
        assert after.dedup_merges - before.dedup_merges == (2 if on else 0)
        assert_all_blocks_free(llm.core)
    assert results[True] == results[False]
    assert results[True][0] == results[True][1] == results[True][2]


def test_preemption_resumes_from_cache_with_same_tokens(default_model_path, llms, tok):
    prompts = [chat_ids(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}])
               for q in ("What is a hammer for?", "What is a saw for?", "Why use a level?", "What is glue?")]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    reference = [o.token_ids for o in llms[False].generate(prompts, params)]  # no memory pressure
    # 4 x (~30 prompt + 20 output) tokens need 16 blocks (13 with the shared first block): 8 force
    # preemptions either way
    assert all(len(p) + 20 <= 4 * BS for p in prompts)
    for on in (True, False):
        small = LLM(str(default_model_path), enable_prefix_caching=on, num_blocks=8, block_size=BS)
        resumed_hits = []
        get_computed = small.core.kv.get_computed_blocks

        def spy(req, *args, get_computed=get_computed, resumed_hits=resumed_hits, **kwargs):
            blocks, num_hit = get_computed(req, *args, **kwargs)
            if req.num_preemptions:
                resumed_hits.append(num_hit)
            return blocks, num_hit

        small.core.kv.get_computed_blocks = spy
        outs = small.generate(prompts, params)
        assert [o.token_ids for o in outs] == reference, f"caching={on}"
        assert small.kv_stats().num_preemptions > 0
        assert resumed_hits
        if on:
            assert max(resumed_hits) > 0, "a preempted request should resume from its cached blocks"
        else:
            assert set(resumed_hits) == {0}
        assert_all_blocks_free(small.core)


def test_requests_arriving_together_compute_a_shared_prefix_once(tiny_model_path):
    """In-batch prefix sharing: of requests admitted together that share a prefix, the first computes it
    and the others wait for its blocks, then read them from the cache, through a chunked prefill too (a
    budget of 8 tokens a step: they wait until the first has passed the shared part). Same tokens as
    without the cache; every block back."""
    shared = list(range(500, 524))  # 6 blocks of 4
    prompts = [shared + [900 + 10 * i + k for k in range(3 + i)] for i in range(5)]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(tiny_model_path), enable_prefix_caching=False, num_blocks=64,
                                      block_size=4).generate(prompts, greedy)]
    for budget in (256, 8):
        llm = LLM(str(tiny_model_path), num_blocks=64, block_size=4, max_num_batched_tokens=budget)
        before = llm.kv_stats()
        outs = llm.generate(prompts, greedy)
        assert [o.token_ids for o in outs] == want
        assert [o.metrics.num_prefix_hit_tokens for o in outs] == [0] + [24] * 4
        assert llm.kv_stats().dedup_merges == before.dedup_merges  # nothing computed twice to merge
        assert_all_blocks_free(llm.core)
