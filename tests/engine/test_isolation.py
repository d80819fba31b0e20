"""One bad request never hurts the others: bad input is refused at add time with a named error,
an error while serving one request fails that request alone, nothing is left behind."""

import gc
import math

import anyio
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from agentrt.engine import AsyncEngine, EngineCore, SamplingParams
from agentrt.engine.outputs import Detokenizer
from agentrt.engine.sampling_params import InvalidRequestError, InvalidRequestTypeError
from tests.conftest import assert_all_blocks_free

MAX_MODEL_LEN = 64
HEALTHY = [[101, 2045, 3306, 712, 88], [4000, 17, 930, 2222]]
HEALTHY_PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    """One AsyncEngine for the module, entered anew by each test (`async with`)."""
    return AsyncEngine(model=str(tiny_model_path), num_blocks=64, block_size=4, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def solo(engine):
    """Tokens of each healthy prompt run alone."""

    async def main():
        async with engine:
            return [(await engine.add_request(p, HEALTHY_PARAMS).result()).token_ids for p in HEALTHY]

    return anyio.run(main)


def assert_clean(eng: AsyncEngine) -> None:
    assert_all_blocks_free(eng.core)
    assert not any(eng.num_tracked().values()), eng.num_tracked()


async def start_healthy(eng: AsyncEngine):
    """Two healthy greedy requests, streaming by the time this returns."""
    streams = [eng.add_request(p, HEALTHY_PARAMS) for p in HEALTHY]
    with anyio.fail_after(30):
        while not all(eng.core.requests.get(s.request_id) and eng.core.requests[s.request_id].num_output_tokens
                      for s in streams):
            await anyio.sleep(0.001)
    return streams


async def finish_healthy(eng: AsyncEngine, streams, solo) -> None:
    for s, want in zip(streams, solo):
        got = []
        async for d in s:
            got.extend(d.new_token_ids)
        out = await s.result()
        assert out.token_ids == got == want and out.finish_reason == "length"
    after = await eng.add_request("and one more", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)).result()
    assert after.num_output_tokens == 3
    assert_clean(eng)


BAD_PARAMS = [
    ("seed", "x"),
    ("seed", -1),
    ("seed", 2**63),
    ("stop", [1]),
    ("stop", [""]),
    ("stop_token_ids", 5),
    ("stop_token_ids", ["a"]),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("top_p", math.nan),
    ("logprobs", -1),
    ("max_tokens", True),
    ("max_tokens", 2.0),
    ("top_logprobs", 21),
    ("top_logprobs", -1),
    ("n", 0),
    ("ignore_eos", "yes"),
    ("top_k", 1.5),
]


@pytest.mark.parametrize("field, value", BAD_PARAMS, ids=[f"{f}={v!r}" for f, v in BAD_PARAMS])
def test_bad_sampling_value_is_refused_while_others_stream(engine, solo, field, value):
    async def main():
        async with engine:
            streams = await start_healthy(engine)
            with pytest.raises((ValueError, TypeError), match=f"SamplingParams.{field} must") as e:
                SamplingParams(**{field: value})
            assert isinstance(e.value, InvalidRequestError)
            changed = SamplingParams(max_tokens=4)
            setattr(changed, field, value)  # changed after construction: caught again at add time
            with pytest.raises((ValueError, TypeError), match=f"SamplingParams.{field} must"):
                engine.add_request("a fine prompt", changed)
            await finish_healthy(engine, streams, solo)

    anyio.run(main)


BAD_ADDS = [
    ("surrogate prompt", lambda: ("hi \ud800 there", None), ValueError, "lone surrogate"),
    ("bytes prompt", lambda: (b"hello", None), TypeError, "prompt must be a str or a list of token ids"),
    ("token id out of vocab", lambda: ([5, 10**6], None), ValueError, "prompt token ids out of range"),
    ("negative token id", lambda: ([5, -1], None), ValueError, "prompt token ids out of range"),
    ("bool token id", lambda: ([5, True], None), TypeError, "prompt token ids must be ints"),
    ("prompt too long", lambda: ([5] * MAX_MODEL_LEN, None), ValueError, "does not fit the model's context"),
    ("empty prompt", lambda: ("", None), ValueError, "prompt is empty"),
    ("dict prompt", lambda: ({"a": 1}, None), TypeError, "prompt must be"),
    ("stop id out of vocab", lambda: ("hi", SamplingParams(stop_token_ids=[10**6])), ValueError, "stop_token_ids"),
    ("params not SamplingParams", lambda: ("hi", {"max_tokens": 3}), TypeError, "params must be SamplingParams"),
]


@pytest.mark.parametrize("make, exc, match", [c[1:] for c in BAD_ADDS], ids=[c[0] for c in BAD_ADDS])
def test_bad_request_is_refused_while_others_stream(engine, solo, make, exc, match):
    async def main():
        async with engine:
            streams = await start_healthy(engine)
            prompt, params = make()
            with pytest.raises(exc, match=match) as e:
                engine.add_request(prompt, params)
            assert isinstance(e.value, (InvalidRequestError, InvalidRequestTypeError))
            await finish_healthy(engine, streams, solo)

    anyio.run(main)


def test_bad_ids_are_refused_and_leave_no_trace(engine, solo):
    async def main():
        async with engine:
            streams = await start_healthy(engine)
            with pytest.raises(TypeError, match="request_id must be"):
                engine.add_request("hi", request_id=7)
            with pytest.raises(ValueError, match="already in use"):
                engine.add_request("hi", request_id=streams[0].request_id)
            with pytest.raises(TypeError, match="program_id must be"):
                engine.add_request("hi", program_id=["p"])
            x = engine.add_request("hi", SamplingParams(max_tokens=2, n=2), request_id="x")
            with pytest.raises(ValueError, match="already in use"):  # the id of x's second completion
                engine.add_request("hi", request_id="x#1")
            await x.result()
            await finish_healthy(engine, streams, solo)

    anyio.run(main)


class ExplodingDetokenizer(Detokenizer):
    def add(self, token_ids, stop_terminated=False):
        if len(self.ids) >= 2:
            raise RuntimeError("boom")
        return Detokenizer.add(self, token_ids, stop_terminated)


def test_error_serving_one_request_fails_it_alone(engine, solo):
    async def main():
        async with engine:
            streams = await start_healthy(engine)
            bad = engine.add_request("this one breaks", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
            while bad.request_id not in engine.core.requests:  # queued while a step runs
                await anyio.sleep(0)
            engine.core._detok[bad.request_id] = ExplodingDetokenizer(engine.tokenizer)
            deltas = []
            with pytest.raises(ValueError, match="boom"):  # the stream ends with the request's error
                async for d in bad:
                    deltas.append(d)
            assert deltas[-1].finished and deltas[-1].finish_reason == "error"
            assert "boom" in deltas[-1].error and bad.request_id in deltas[-1].error
            with pytest.raises(ValueError, match="boom"):
                await bad.result()
            await finish_healthy(engine, streams, solo)

    anyio.run(main)


def test_error_serving_one_fork_fails_that_fork_alone(engine):
    async def main():
        async with engine:
            s = engine.add_request([7, 8, 9], SamplingParams(n=3, max_tokens=6, temperature=0, ignore_eos=True))
            with anyio.fail_after(30):
                while "#1" not in "".join(engine.core.requests):  # forked after the first token
                    await anyio.sleep(0.001)
            engine.core._detok[f"{s.request_id}#1"] = ExplodingDetokenizer(engine.tokenizer)
            out = await s.result()
            assert [o.finish_reason for o in out.outputs] == ["length", "error", "length"]
            assert out.outputs[0].token_ids == out.outputs[2].token_ids and len(out.outputs[0].token_ids) == 6
            assert_clean(engine)

    anyio.run(main)


def test_failed_forward_fails_its_batch_only(tiny_model_path, monkeypatch):
    core = EngineCore(model=str(tiny_model_path), num_blocks=64, block_size=4, max_num_seqs=1)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    want = core.add_request(HEALTHY[1], params)
    while core.has_work():
        core.step()
    want = core.finished_output(want).token_ids
    a = core.add_request(HEALTHY[0], params)
    b = core.add_request(HEALTHY[1], params)  # waits: one request per batch
    execute = core.runner.execute

    def broken(out):
        raise RuntimeError("device lost")

    monkeypatch.setattr(core.runner, "execute", broken)
    deltas = core.step()
    assert [(d.request_id, d.finish_reason) for d in deltas] == [(a.request_id, "error")]
    assert "device lost" in a.error
    monkeypatch.setattr(core.runner, "execute", execute)
    while core.has_work():
        core.step()
    assert core.finished_output(a).finish_reason == "error"
    assert core.finished_output(b).token_ids == want
    assert_all_blocks_free(core)
    assert not any(core.num_tracked().values())


def test_step_failure_outside_any_request_keeps_the_engine_serving(engine, monkeypatch):
    async def main():
        async with engine:
            schedule = engine.core.scheduler.schedule
            calls = []

            def flaky():
                calls.append(1)
                if len(calls) == 3:
                    raise RuntimeError("scheduler bug")
                return schedule()

            monkeypatch.setattr(engine.core.scheduler, "schedule", flaky)
            s = engine.add_request("doomed", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
            with pytest.raises(ValueError, match="scheduler bug"):
                await s.result()
            monkeypatch.setattr(engine.core.scheduler, "schedule", schedule)
            ok = await engine.add_request("fine", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)).result()
            assert ok.num_output_tokens == 3
            assert_clean(engine)

    anyio.run(main)


def test_abandoned_stream_aborts_its_request(engine, solo):
    async def main():
        async with engine:
            streams = await start_healthy(engine)
            s = engine.add_request("nobody reads this", SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
            it = s.__aiter__()
            await it.__anext__()
            await it.aclose()
            req = engine.core.requests[s.request_id]
            del s, it
            gc.collect()
            with anyio.fail_after(30):
                while not req.finished:
                    await anyio.sleep(0.001)
            assert req.finish_reason == "abort" and req.num_output_tokens < 50
            await finish_healthy(engine, streams, solo)

    anyio.run(main)


def test_abort_before_the_add_is_applied(engine, solo):
    async def main():
        async with engine:
            streams = await start_healthy(engine)
            while not engine._stepping:
                await anyio.sleep(0)
            s = engine.add_request("queued", SamplingParams(max_tokens=5, n=2))  # queued behind the running step
            engine.abort(s.request_id)
            out = await s.result()
            assert [o.finish_reason for o in out.outputs] == ["abort", "abort"]
            await finish_healthy(engine, streams, solo)

    anyio.run(main)


# ---- property: any value for any field --------------------------------------------------------
WILD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.one_of(st.integers(-3, 60_000), st.text(max_size=3), st.none(), st.booleans(), st.floats()), max_size=3),
)
FIELDS = {
    "max_tokens": st.one_of(st.integers(1, 8), st.integers(1, 2**70)),
    "temperature": st.floats(0, 2),
    "top_k": st.one_of(st.just(-1), st.integers(1, 60_000)),
    "top_p": st.floats(0.01, 1),
    "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 49_151), max_size=3),
    "ignore_eos": st.booleans(),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 20),
    "n": st.integers(1, 3),
}
GOOD_PROMPTS = st.one_of(
    st.text(min_size=1, max_size=12),
    st.lists(st.integers(0, 49_151), min_size=1, max_size=MAX_MODEL_LEN - 1),
)
WILD_PROMPTS = st.one_of(
    WILD,
    st.just("ab\ud800c"),
    st.binary(max_size=4),
    st.lists(st.one_of(st.integers(-3, 50_000), st.booleans(), st.text(max_size=2)), max_size=8),
    st.lists(st.integers(0, 49_151), min_size=MAX_MODEL_LEN - 2, max_size=MAX_MODEL_LEN + 2),
)


@st.composite
def requests(draw):
    """A prompt and SamplingParams keyword arguments, one or two of them drawn from anything at all."""
    wild = draw(st.sets(st.sampled_from([*FIELDS, "prompt"]), max_size=2))
    kwargs = {}
    for name, good in FIELDS.items():
        if name in wild:
            kwargs[name] = draw(WILD)
        elif draw(st.booleans()):
            kwargs[name] = draw(good)
    return draw(WILD_PROMPTS if "prompt" in wild else GOOD_PROMPTS), kwargs


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_any_request_is_refused_or_served_and_never_hurts_another(engine, solo, request):
    prompt, kwargs = request

    async def main():
        async with engine:
            healthy = engine.add_request(HEALTHY[0], HEALTHY_PARAMS)
            try:
                stream = engine.add_request(prompt, SamplingParams(**kwargs))
            except (ValueError, TypeError) as e:
                assert isinstance(e, (InvalidRequestError, InvalidRequestTypeError)), e
                event("refused")
            else:
                event("served")
                out = await stream.result()
                assert all(o.finish_reason in ("stop", "length") for o in out.outputs)
                assert len(out.outputs) == kwargs.get("n", 1)
            assert (await healthy.result()).token_ids == solo[0]
            assert_clean(engine)

    anyio.run(main)
