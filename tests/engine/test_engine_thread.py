"""The engine's own thread: built and stepped on one thread, errors handed back, steps never abandoned."""

from __future__ import annotations

import gc
import threading
import time

import anyio
import pytest

from agentrt.engine import AsyncEngine, SamplingParams
from agentrt.engine.engine_thread import EngineThread


def test_call_and_run_return_values_and_raise_errors():
    t = EngineThread()
    assert t.call(lambda: threading.get_ident()) == t.ident != threading.get_ident()
    with pytest.raises(ValueError, match="bad"):
        t.call(lambda: (_ for _ in ()).throw(ValueError("bad")))

    async def main():
        assert await t.run(lambda: threading.get_ident()) == t.ident
        with pytest.raises(KeyError):
            await t.run(lambda: {}["missing"])

    anyio.run(main)
    t.close()


def test_a_cancelled_caller_still_waits_for_the_job():
    t = EngineThread()
    finished = []

    def slow():
        time.sleep(0.3)
        finished.append(time.monotonic())

    async def main():
        with anyio.move_on_after(0.05):
            await t.run(slow)
        return time.monotonic()

    returned = anyio.run(main)
    assert finished and finished[0] <= returned  # the job ran to its end before the caller went on
    t.close()


def test_the_thread_stops_when_closed_or_collected():
    t = EngineThread(name="agentrt-test-close")
    t.call(lambda: None)
    t.close()
    t._thread.join(timeout=5)
    assert not t._thread.is_alive()
    t2 = EngineThread(name="agentrt-test-gc")
    thread = t2._thread
    del t2
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


@pytest.mark.slow
def test_async_engine_is_built_and_stepped_on_one_thread():
    """OpenMP keeps a thread pool per thread that runs parallel regions; building on the event loop's
    thread and stepping on another made CPU steps ~1.5x slower (engine/engine_thread.py)."""
    built_on = {}
    import agentrt.engine.engine_core as ec

    real_init = ec.EngineCore.__init__

    def spy(self, *a, **k):
        built_on["ident"] = threading.get_ident()
        real_init(self, *a, **k)

    ec.EngineCore.__init__ = spy
    try:
        eng = AsyncEngine(None, max_num_seqs=2, max_num_batched_tokens=64, num_blocks=64)
    finally:
        ec.EngineCore.__init__ = real_init
    stepped_on = set()
    eng.core.on_schedule = lambda out: stepped_on.add(threading.get_ident())

    async def main():
        async with eng:
            out = await eng.add_request([1, 2, 3, 4], SamplingParams(max_tokens=3, ignore_eos=True)).result()
            assert len(out.outputs[0].token_ids) == 3

    anyio.run(main)
    assert stepped_on == {built_on["ident"]} and built_on["ident"] != threading.get_ident()
    assert eng.core.kv.num_free_blocks == eng.core.kv.num_blocks


def test_close_stops_the_thread_and_a_runtime_closes_its_engine(tiny_model_path):
    import agentrt
    from agentrt.engine.async_engine import EngineError

    async def main():
        async with agentrt.Runtime(str(tiny_model_path), max_num_seqs=2, num_blocks=32) as rt:
            await agentrt.generate([5, 6, 7], max_tokens=2, ignore_eos=True)
            eng = rt.engine
            with pytest.raises(EngineError, match="serving"):
                eng.close()
        return eng

    eng = anyio.run(main)
    eng._thread._thread.join(timeout=5)
    assert eng._thread.closed and not eng._thread._thread.is_alive()

    async def again():
        async with eng:
            pass

    with pytest.raises(EngineError, match="closed"):
        anyio.run(again)
