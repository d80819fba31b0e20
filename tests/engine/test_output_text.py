"""What a completion's text holds, as vLLM's SamplingParams has it: `include_stop_str_in_output` (the
stop string that ended it, or the text of the EOS / stop token that did; without it neither, while
the token ids keep the stop token) and `skip_special_tokens` (special tokens' text left out, the
default). Streamed pieces always add up to the final text."""

import pytest

from agentrt.engine import LLM, SamplingParams
from agentrt.engine.outputs import Detokenizer
from tests.conftest import assert_all_blocks_free
from tests.engine.test_engine import prompts_of


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(str(tiny_model_path), num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)


def greedy(**kw):
    return SamplingParams(**{"max_tokens": 12, "temperature": 0, "ignore_eos": True, **kw})


def test_stop_string_kept_with_include_stop_str_in_output(llm):
    p = prompts_of([7], seed=5)[0]
    full = llm.generate(p, greedy())[0]
    text = full.text
    needle = next(text[i : i + 3] for i in range(len(text) // 3, len(text) - 3) if text[i : i + 3].strip())
    cut = llm.generate(p, greedy(stop=[needle]))[0]
    kept = llm.generate(p, greedy(stop=[needle], include_stop_str_in_output=True))[0]
    at = text.index(needle)
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert cut.text == text[:at]
    assert kept.text == text[: at + len(needle)]
    assert kept.token_ids == cut.token_ids  # the same tokens: only the text differs
    assert cut.outputs[0].stop_reason == kept.outputs[0].stop_reason == needle  # vLLM's stop_reason
    assert full.outputs[0].stop_reason is None  # "length"
    assert_all_blocks_free(llm.core)


def test_stop_token_text_only_with_include_stop_str_in_output(llm, tiny_model_path):
    p = prompts_of([7], seed=5)[0]
    full = llm.generate(p, greedy())[0]
    stop_tok = full.token_ids[4]
    tok = llm.tokenizer
    k = full.token_ids.index(stop_tok)
    cut = llm.generate(p, greedy(stop_token_ids=[stop_tok]))[0]
    kept = llm.generate(p, greedy(stop_token_ids=[stop_tok], include_stop_str_in_output=True))[0]
    assert cut.token_ids == kept.token_ids == full.token_ids[: k + 1]  # the ids keep the stop token
    assert cut.text == tok.decode(full.token_ids[:k], skip_special_tokens=True)
    assert kept.text == tok.decode(full.token_ids[: k + 1], skip_special_tokens=True)
    assert kept.text != cut.text
    assert cut.outputs[0].stop_reason == kept.outputs[0].stop_reason == stop_tok


def test_eos_text_needs_both_options(llm):
    """EOS ends the output; its text (a special token) shows only with include_stop_str_in_output and
    skip_special_tokens=False."""
    tok = llm.tokenizer
    eos = tok.eos_token_id
    force = {"logit_bias": {eos: 100.0}, "ignore_eos": False}
    texts = {}
    for include in (False, True):
        for skip in (True, False):
            out = llm.generate([5, 6, 7], greedy(include_stop_str_in_output=include, skip_special_tokens=skip, **force))[0]
            assert out.token_ids == [eos] and out.finish_reason == "stop" and out.outputs[0].stop_reason is None
            texts[include, skip] = out.text
    assert texts == {(False, True): "", (False, False): "", (True, True): "", (True, False): tok.eos_token}


def test_special_tokens_in_the_text_only_when_not_skipped(llm):
    tok = llm.tokenizer
    special = next(i for i in tok.all_special_ids if i != tok.eos_token_id)
    outs = {skip: llm.generate([5, 6, 7], greedy(max_tokens=3, logit_bias={special: 100.0}, skip_special_tokens=skip))[0]
            for skip in (True, False)}
    assert outs[True].token_ids == outs[False].token_ids == [special] * 3
    assert outs[True].text == ""
    assert outs[False].text == tok.convert_ids_to_tokens(special) * 3


@pytest.mark.parametrize("include", [False, True])
def test_streamed_pieces_add_up_to_the_text(llm, include):
    """A stop string split over several tokens: with include nothing needs holding back, without it the
    stream never shows the stop string's start."""
    p = prompts_of([9], seed=11)[0]
    text = llm.generate(p, greedy(max_tokens=16))[0].text
    needle = text[len(text) // 2 : len(text) // 2 + 5]
    d = Detokenizer(llm.tokenizer, [needle], include_stop=include)
    ids = llm.generate(p, greedy(max_tokens=16))[0].token_ids
    at = text.index(needle)
    pieces, stopped = [], False
    for t in ids:
        stopped = d.add([t])
        pieces.append(d.take(final=stopped))
        if stopped:
            break
        if include:
            assert "".join(pieces) == d.text  # nothing held back
        else:
            assert len("".join(pieces)) <= at  # never past where the stop string starts
    assert stopped
    assert "".join(pieces) == (text[: at + len(needle)] if include else text[:at])


def test_options_are_checked():
    with pytest.raises(TypeError, match="include_stop_str_in_output"):
        SamplingParams(include_stop_str_in_output="yes")
    with pytest.raises(TypeError, match="skip_special_tokens"):
        SamplingParams(skip_special_tokens=1)
