"""vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens.

The sampler's masks against plain per-row references, batched with rows that use none (left
unchanged); then in the engine: every sampled token allowed (seeded, many tokens, forks), a bad word
taken from an unbanned greedy run no longer generated (one token, and two), a truncated prompt
generating exactly what the cut prompt does, and bad values refused at add naming the field.
"""

import math

import pytest
import torch

from agentrt.engine import LLM, SamplingParams
from agentrt.engine.sampling import RowContext, mask_logits, sample
from agentrt.engine.sampling_params import InvalidRequestError, truncate_prompt
from tests.conftest import assert_all_blocks_free

V = 300
KW = dict(num_blocks=128, block_size=4, max_num_batched_tokens=64, max_num_seqs=16)
PROMPT = [311, 4090, 77, 1500, 23, 9000, 42, 311, 77]


def with_bad_words(p: SamplingParams, words: list[list[int]]) -> SamplingParams:
    p.bad_words_token_ids = words  # what RequestChecks.validate_params sets from p.bad_words
    return p


def context(prompt: list[int], output: list[int]) -> RowContext:
    return RowContext(torch.tensor(prompt + output), len(prompt), [])


# ---- the sampler ----------------------------------------------------------------------------------
def test_allowed_token_ids_mask_others_and_logprobs_are_of_the_masked_distribution():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0)) * 3
    allowed = [5, 17, 299, 17]
    p = SamplingParams(temperature=0, logprobs=True, top_logprobs=4, allowed_token_ids=allowed)
    plain = SamplingParams(temperature=0, logprobs=True, top_logprobs=4)
    out = sample(logits.clone(), [p, plain], [None, None])
    masked = torch.full((V,), -math.inf)
    masked[allowed] = logits[0, allowed]
    want = masked.log_softmax(-1)
    assert out.token_ids.tolist() == [int(masked.argmax()), int(logits[1].argmax())]
    assert out.logprobs[0].item() == pytest.approx(want.max().item())
    assert sorted(out.top_token_ids[0, :3].tolist()) == [5, 17, 299] and math.isinf(out.top_logprobs[0, 3].item())
    assert out.logprobs[1].item() == pytest.approx(logits[1].log_softmax(-1).max().item())  # the plain row: raw


def test_bad_words_ban_a_words_last_token_where_the_output_ends_with_the_rest():
    words = [[7], [3, 4], [1, 2, 9]]
    cases = {  # output so far -> tokens banned next
        (): {7},
        (3,): {7, 4},
        (1, 2): {7, 9},
        (2,): {7},
        (1, 2, 3): {7, 4},
        (5, 1, 2): {7, 9},
    }
    rows = list(cases)
    logits = torch.zeros(len(rows) + 1, V)
    params = [with_bad_words(SamplingParams(temperature=0), words) for _ in rows] + [SamplingParams(temperature=0)]
    contexts = [context([3, 1, 2], list(o)) for o in rows] + [None]  # the prompt never counts
    out = sample(logits, params, [None] * len(params), contexts)
    assert out.token_ids.tolist()[-1] == 0  # the plain row: argmax of zeros, unchanged
    masked = mask_logits(logits, params, contexts)
    for i, o in enumerate(rows):
        assert set(torch.nonzero(torch.isinf(masked[i])).flatten().tolist()) == cases[o], o
    assert not torch.isinf(masked[-1]).any()


def test_truncate_prompt_keeps_the_last_tokens():
    ids = list(range(10))
    assert truncate_prompt(ids, None, 8) == ids
    assert truncate_prompt(ids, 3, 8) == [7, 8, 9]
    assert truncate_prompt(ids, 20, 8) == ids
    assert truncate_prompt(ids, -1, 8) == list(range(3, 10))  # max_model_len - 1: room for one output token
    for bad in (0, -2, 1.5, True):
        with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
            truncate_prompt(ids, bad, 8)


@pytest.mark.parametrize("kwargs,match", [
    ({"allowed_token_ids": []}, "allowed_token_ids must be None or a non-empty list"),
    ({"allowed_token_ids": [3, -1]}, r"allowed_token_ids must be token ids >= 0, got -1"),
    ({"allowed_token_ids": ["a"]}, "allowed_token_ids must be a list of int"),
    ({"bad_words": "word"}, "bad_words must be a list of str"),
    ({"bad_words": ["ok", "  "]}, "bad_words must be words with a non-space character, got '  '"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be -1"),
])
def test_bad_values_are_refused_naming_the_field(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


# ---- in the engine --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(str(tiny_model_path), **KW)


def test_allowed_token_ids_restrict_every_sampled_token(llm):
    allowed = [42, 787, 1000, 9805, 30000]
    p = SamplingParams(max_tokens=48, temperature=1.0, seed=3, ignore_eos=True, allowed_token_ids=allowed, n=2,
                       logprobs=True)
    out = llm.generate([PROMPT, PROMPT], [p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)])
    for comp in out[0].outputs:
        assert len(comp.token_ids) == 48 and set(comp.token_ids) <= set(allowed)
        assert len(set(comp.token_ids)) > 1 and all(lp > -math.inf for lp in comp.logprobs)
    assert not set(out[1].token_ids) <= set(allowed)  # the unrestricted request batched with it
    assert_all_blocks_free(llm.core)


def test_allowed_token_id_out_of_the_vocabulary_is_refused(llm):
    vocab = llm.core.model.args.vocab_size
    with pytest.raises(InvalidRequestError, match=rf"allowed_token_ids must be < the vocabulary size {vocab}, got \[{vocab}\]"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=[5, vocab]))
    assert_all_blocks_free(llm.core)


def bad_word_ids(llm, word: str) -> list[list[int]]:
    """How the engine tokenizes a bad word (with and without a leading space, as vLLM)."""
    return llm.core.admit(PROMPT, SamplingParams(bad_words=[word])).params.bad_words_token_ids


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_a_one_token_bad_word_is_never_generated(llm):
    free = llm.generate([PROMPT], GREEDY)[0].token_ids
    for t in free:
        word = llm.tokenizer.decode([t])
        if word.strip() and [t] in bad_word_ids(llm, word):
            break
    else:
        pytest.fail(f"no token of the greedy output {free} is a word of its own")
    banned = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, bad_words=[word]))[0]
    first = free.index(t)
    assert banned.token_ids[:first] == free[:first] and t not in banned.token_ids
    assert not any([x] in bad_word_ids(llm, word) for x in banned.token_ids)


def test_a_two_token_bad_word_loses_its_last_token_after_its_first(llm):
    free = llm.generate([PROMPT], GREEDY)[0].token_ids
    for j in range(1, len(free)):
        word = llm.tokenizer.decode(free[j - 1 : j + 1])
        if word.strip() and free[j - 1 : j + 1] in bad_word_ids(llm, word):
            break
    else:
        pytest.fail(f"no two tokens of the greedy output {free} are a word")
    seqs = bad_word_ids(llm, word)
    banned = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, bad_words=[word]))[0]
    out = banned.token_ids
    assert out[:j] == free[:j] and out[j] != free[j]  # the same until the word's last token, then not
    assert not any(out[i : i + len(s)] == s for s in seqs for i in range(len(out)))
    assert free[j - 1] in out  # the first token alone is not banned


def test_bad_words_carry_no_drafts_and_keep_their_tokens(tiny_model_path, llm):
    loop = PROMPT * 3
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, bad_words=["the", " of them"])
    spec = LLM(str(tiny_model_path), num_speculative_tokens=3, **KW)
    assert spec.generate([loop], p)[0].token_ids == llm.generate([loop], p)[0].token_ids
    assert spec.core.num_draft_tokens == 0


def test_truncated_prompt_generates_what_the_cut_prompt_does(llm):
    long = PROMPT * 3
    cut = llm.generate([long], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, truncate_prompt_tokens=7))[0]
    given = llm.generate([long[-7:]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert cut.prompt_token_ids == long[-7:] and cut.num_prompt_tokens == 7
    assert cut.token_ids == given.token_ids
    text = llm.tokenizer.decode(long)
    by_text = llm.generate([text], SamplingParams(max_tokens=4, temperature=0, truncate_prompt_tokens=5))[0]
    assert by_text.prompt_token_ids == llm.tokenizer(text)["input_ids"][-5:]


def test_truncate_to_the_context_makes_a_long_prompt_fit(tiny_model_path):
    small = LLM(str(tiny_model_path), max_model_len=16, **KW)
    long = PROMPT * 3  # 27 tokens: over the context
    with pytest.raises(InvalidRequestError, match="does not fit"):
        small.generate([long], SamplingParams(max_tokens=4))
    out = small.generate([long], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, truncate_prompt_tokens=-1))[0]
    assert out.prompt_token_ids == long[-15:] and len(out.token_ids) == 1 and out.finish_reason == "length"
    assert_all_blocks_free(small.core)
