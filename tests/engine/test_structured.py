"""Structured generation: every constrained output matches its grammar, whatever decodes it.

On the real default model (slow): JSON schemas of every common shape, greedy and sampled, with forks
and under preemption, all parse and validate; regexes and an EBNF grammar fully match; a constraint
that does not compile is refused at add time and leaves nothing behind. On the tiny random model
(fast): the mechanics, where the weights cannot help: the mask alone keeps the output in the grammar,
a constrained request leaves its unconstrained batch-mates untouched, speculation, the grammar cache.
"""

import json
import re

import jsonschema
import pytest
import torch

from agentrt.engine import LLM, SamplingParams
from agentrt.engine.sampling_params import InvalidRequestError
from agentrt.engine.structured import Constraint, GrammarCache, apply_constraints
from tests.conftest import assert_all_blocks_free, requires_default_model


def slow(fn):
    """A test on the real default model."""
    return requires_default_model(pytest.mark.slow(fn))


# (what to ask for, schema): strings bounded so sampled outputs end
SCHEMAS = [
    ("a user record with a nested user object", {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 16},
                "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            }, "required": ["name", "id"], "additionalProperties": False},
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"], "additionalProperties": False,
    }),
    ("a list of two to four test scores", {
        "type": "object",
        "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                                  "minItems": 2, "maxItems": 4}},
        "required": ["scores"], "additionalProperties": False,
    }),
    ("a T-shirt's color and size", {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "string", "enum": ["S", "M", "L"]}},
        "required": ["color", "size"], "additionalProperties": False,
    }),
    ("today's weather", {
        "type": "object",
        "properties": {"celsius": {"type": "number", "minimum": -40, "maximum": 50},
                       "rain_chance": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["celsius", "rain_chance"], "additionalProperties": False,
    }),
    ("a book, with a subtitle and year if it has them", {
        "type": "object",
        "properties": {"title": {"type": "string", "minLength": 1, "maxLength": 24},
                       "subtitle": {"type": "string", "maxLength": 24},
                       "year": {"type": "integer", "minimum": 1400, "maximum": 2030}},
        "required": ["title"], "additionalProperties": False,
    }),
    ("a flight code and an email address", {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                       "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
        "required": ["code", "email"], "additionalProperties": False,
    }),
    ("a measurement: a small integer count or a word", {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                           {"type": "string", "enum": ["none", "many"]}]}},
        "required": ["value"], "additionalProperties": False,
    }),
]

# a long output: three records, for the preemption test
LONG_SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                       "age": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "age"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False,
}


def chat_prompt(tok, text: str) -> list[int]:
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok(rendered, add_special_tokens=False)["input_ids"]


def assert_valid(completion, schema) -> None:
    assert completion.finish_reason == "stop", (completion.finish_reason, completion.text)
    jsonschema.validate(json.loads(completion.text), schema)


def assert_clean(core) -> None:
    assert_all_blocks_free(core)
    assert not any(core.num_tracked().values()), core.num_tracked()


# --- the real model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(default_model_path):
    return LLM(str(default_model_path), num_blocks=512)


@pytest.fixture(scope="module")
def schema_prompts(llm):
    return [chat_prompt(llm.tokenizer, f"Reply in JSON with {what}.") for what, _ in SCHEMAS]


@slow
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled-n3"])
def test_json_schemas(llm, schema_prompts, sampled):
    params = [
        SamplingParams(max_tokens=200, temperature=1.0 if sampled else 0.0, seed=7 + i if sampled else None,
                       n=3 if sampled else 1, constraint=Constraint.json_schema(schema))
        for i, (_, schema) in enumerate(SCHEMAS)
    ]
    outs = llm.generate(schema_prompts, params)
    for out, (_, schema) in zip(outs, SCHEMAS):
        assert len(out.outputs) == (3 if sampled else 1)
        for c in out.outputs:
            assert_valid(c, schema)
    assert_clean(llm.core)


@slow
def test_properties_come_in_the_schema_order(llm):
    # not alphabetical: a schema's properties are written in its order (a tool call's name before its arguments)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "city": {"enum": ["Paris", "Lima"]}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    prompt = chat_prompt(llm.tokenizer, "Reply in JSON with a person's city, age and name.")
    params = SamplingParams(max_tokens=100, temperature=0, constraint=Constraint.json_schema(schema))
    (out,) = llm.generate([prompt], params)
    assert_valid(out.outputs[0], schema)
    assert list(json.loads(out.text)) == ["name", "age", "city"]
    assert_clean(llm.core)


@slow
def test_json_schemas_under_preemption(default_model_path):
    # 3 sequences of ~50 prompt + ~70 output tokens (~8 blocks each) in 13 blocks: preemption is forced
    llm = LLM(str(default_model_path), num_blocks=13, max_num_seqs=4)
    asks = ["three people from a novel", "three members of a chess club"]
    prompts = [chat_prompt(llm.tokenizer, f"Reply in JSON with {a}, each with a name and an age.") for a in asks]
    c = Constraint.json_schema(LONG_SCHEMA)
    params = [SamplingParams(max_tokens=150, temperature=0, constraint=c),
              SamplingParams(max_tokens=150, temperature=1.0, seed=3, n=2, constraint=c)]
    outs = llm.generate(prompts, params)
    assert llm.kv_stats().num_preemptions > 0
    for out in outs:
        for comp in out.outputs:
            assert_valid(comp, LONG_SCHEMA)
    assert_clean(llm.core)


@slow
def test_regexes_and_a_grammar_fully_match(llm):
    grammar = 'root ::= "The answer is " num " " unit "."\nnum ::= [1-9] [0-9]?\nunit ::= "apples" | "pears"'
    choices = ["positive", "negative", "neutral"]
    cases = [  # (question, constraint, what the whole output must match)
        ("Give a US phone number.", Constraint("regex", r"\(\d{3}\) \d{3}-\d{4}"), r"\(\d{3}\) \d{3}-\d{4}"),
        ("When was the Eiffel Tower finished? Give the date.", Constraint("regex", r"\d{4}-\d{2}-\d{2}"),
         r"\d{4}-\d{2}-\d{2}"),
        # guided_choice as the server builds it: the escaped choices joined by "|"
        ("Is 'I love this phone' positive, negative or neutral?",
         Constraint("regex", "|".join(re.escape(c) for c in choices)), "|".join(choices)),
        ("How many apples are in a bag of 12 apples?", Constraint("grammar", grammar),
         r"The answer is [1-9][0-9]? (apples|pears)\."),
    ]
    prompts = [chat_prompt(llm.tokenizer, q) for q, _, _ in cases]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=40, temperature=0, constraint=c) for _, c, _ in cases])
    for out, (_, _, pattern) in zip(outs, cases):
        assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), (out.finish_reason, out.text)
    assert_clean(llm.core)


BAD = [
    (Constraint.json_schema({"type": "object", "properties": {"a": {"type": "nonsense"}}}), "json_schema"),
    (Constraint("json_schema", '{"type": '), "json_schema"),
    (Constraint("regex", "(unclosed"), "regex"),
    (Constraint("regex", "[a-"), "regex"),
    (Constraint("grammar", "root ::= undefined_rule"), "grammar"),
]


@slow
@pytest.mark.parametrize("bad,kind", BAD, ids=[f"{k}-{i}" for i, (_, k) in enumerate(BAD)])
def test_bad_constraint_refused_at_add_without_a_trace(llm, schema_prompts, bad, kind):
    core = llm.core
    with pytest.raises(InvalidRequestError, match=rf"SamplingParams\.constraint: {kind} constraint does not compile"):
        core.add_request(schema_prompts[0], SamplingParams(max_tokens=8, constraint=bad))
    assert_clean(core)
    good = SamplingParams(max_tokens=8, constraint=Constraint.json_schema(SCHEMAS[0][1]))
    with pytest.raises(ValueError, match=kind):  # a good request beside it is not run either
        llm.generate(schema_prompts[:2], [good, SamplingParams(max_tokens=8, constraint=bad)])
    assert_clean(core)


def test_constraint_checked_on_construction():
    with pytest.raises(ValueError, match="kind"):
        Constraint("xml", "<a/>")
    with pytest.raises(ValueError, match="non-empty spec"):
        Constraint("regex", "")
    with pytest.raises(TypeError, match="SamplingParams.constraint"):
        SamplingParams(constraint={"type": "json_object"})


# --- the tiny random model: mechanics -------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    return LLM(str(tiny_model_path), num_blocks=128, max_num_seqs=16)


PROMPTS = [[101, 2045, 3306, 712, 88], [4000, 17, 930, 2222], [5, 6, 7, 8, 9, 10]]


def test_mask_allows_only_grammar_tokens(tiny):
    # random weights would never write "yes" or "no": the mask alone does
    c = Constraint("regex", "(yes|no)")
    outs = tiny.generate(PROMPTS, [SamplingParams(max_tokens=8, temperature=0, constraint=c),
                                   SamplingParams(max_tokens=8, temperature=1.0, seed=1, n=4, constraint=c),
                                   SamplingParams(max_tokens=8, temperature=1.0, top_k=5, constraint=c)])
    texts = [comp.text for out in outs for comp in out.outputs]
    assert len(texts) == 6 and set(texts) <= {"yes", "no"}, texts
    assert all(comp.finish_reason == "stop" for out in outs for comp in out.outputs)
    assert_clean(tiny.core)


def test_apply_constraints_masks_only_constrained_rows(tiny):
    core = tiny.core
    core.compile_constraint(Constraint("regex", "(yes|no)"))
    m = core.checks.grammars.matcher(Constraint("regex", "(yes|no)"))
    vocab = core.model.args.vocab_size
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    apply_constraints(logits, [None, m, None])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert torch.equal(logits[1, allowed], before[1, allowed])
    texts = [core.tokenizer.decode([t]) for t in allowed]
    assert allowed and all(t and ("yes".startswith(t) or "no".startswith(t)) for t in texts), texts


def test_constrained_and_free_requests_in_one_batch(tiny):
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    (solo,) = tiny.generate([PROMPTS[0]], free)
    constrained = [SamplingParams(max_tokens=16, temperature=0, constraint=Constraint("regex", r"[0-9]{3}-[a-z]{2}")),
                   SamplingParams(max_tokens=16, temperature=1.0, seed=5, n=2,
                                  constraint=Constraint("regex", "(yes|no)"))]
    outs = tiny.generate(PROMPTS, [free, *constrained])
    assert outs[0].token_ids == solo.token_ids
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[1].text) and outs[1].finish_reason == "stop"
    assert {c.text for c in outs[2].outputs} <= {"yes", "no"}
    assert_clean(tiny.core)


def test_speculative_engine_keeps_constrained_output_valid(tiny_model_path):
    llm = LLM(str(tiny_model_path), num_blocks=64, num_speculative_tokens=3)
    core = llm.core
    repetitive = [7, 8, 9, 10] * 6  # prompt lookup finds drafts in it
    pattern = r"[a-c]{4}-[0-9]{2}"
    outs = llm.generate([repetitive, PROMPTS[1]],
                        [SamplingParams(max_tokens=16, temperature=0, constraint=Constraint("regex", pattern))] * 2)
    assert all(re.fullmatch(pattern, o.text) and o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    assert core.num_draft_tokens == 0  # constrained requests are not speculated on
    tiny_free = llm.generate([repetitive], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert core.num_draft_tokens > 0 and len(tiny_free[0].token_ids) == 16  # the engine does speculate
    assert_clean(core)


def test_compiled_grammars_are_cached(tiny):
    core = tiny.core
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    tiny.generate(PROMPTS[:1], SamplingParams(max_tokens=4, constraint=Constraint.json_schema(schema)))
    cache: GrammarCache = core.checks.grammars
    compiles, hits = cache.num_compiles, cache.num_hits
    same = Constraint.json_schema(json.loads(json.dumps(schema)))  # equal, not the same object
    tiny.generate(PROMPTS, SamplingParams(max_tokens=4, n=2, constraint=same))
    assert cache.num_compiles == compiles and cache.num_hits > hits
    tiny.generate(PROMPTS[:1], SamplingParams(max_tokens=4, constraint=Constraint("regex", "[ab]+")))
    assert cache.num_compiles == compiles + 1
    assert_clean(core)


def test_a_grammar_at_a_dead_end_ends_the_output_like_max_tokens(tiny):
    """A regex whose characters' bytes no token of the vocabulary spells (found by the schema fuzz test):
    after the tokens that do spell its start, the grammar allows nothing. The output ends there with
    finish_reason "length" (not a failed request with a token the grammar refused), the batch's other
    request is untouched, and every block comes back."""
    regex = "\x84\x99\U000863e1!"
    free = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    stuck, other = tiny.generate([[1, 2, 3], [4, 5, 6]], [SamplingParams(max_tokens=10, constraint=Constraint(
        "regex", regex)), free])
    assert stuck.finish_reason == "length" and 1 <= len(stuck.token_ids) < 10 and stuck.outputs[0].error is None
    assert regex.startswith(stuck.text) and stuck.text != regex
    assert other.token_ids == tiny.generate([[4, 5, 6]], free)[0].token_ids
    assert_all_blocks_free(tiny.core)


@pytest.mark.parametrize("drafts", [0, 3], ids=["plain", "n-gram-drafts"])
def test_a_grammar_waits_for_its_after_tokens(tiny_model_path, drafts):
    """Constraint.after (the end of thinking, with a reasoning parser): the output is free, and equal to an
    unconstrained one, up to and including the first occurrence of those tokens; the grammar holds the rest.
    Never reached, the grammar never applies."""
    llm = LLM(str(tiny_model_path), num_blocks=128, num_speculative_tokens=drafts)
    free = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                        progress=False)
    regex = "(yes|no)"
    for prompt, out in zip(PROMPTS, free, strict=True):
        ids = out.outputs[0].token_ids
        k = next(i for i in range(2, 8) if ids[i : i + 2] not in [ids[j : j + 2] for j in range(i)])
        after = tuple(ids[k : k + 2])  # first seen at k: the grammar starts at k + 2
        params = SamplingParams(max_tokens=12, temperature=0, n=2, seed=1,
                                constraint=Constraint("regex", regex, after=after))
        got = llm.generate([prompt], params, progress=False)[0]
        for c in got.outputs:
            assert c.token_ids[: k + 2] == ids[: k + 2]
            assert re.fullmatch(regex, llm.tokenizer.decode(c.token_ids[k + 2:], skip_special_tokens=True))
            assert c.finish_reason == "stop"
        never = Constraint("regex", regex, after=(llm.core.model.args.vocab_size - 1,) * 3)
        got = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, constraint=never),
                           progress=False)[0]
        assert got.outputs[0].token_ids == ids
    with pytest.raises(InvalidRequestError, match="constraint.after"):
        llm.generate(PROMPTS[:1], SamplingParams(constraint=Constraint("regex", regex, after=(10**9,))),
                     progress=False)
    assert_all_blocks_free(llm.core)
