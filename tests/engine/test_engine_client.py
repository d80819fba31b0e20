"""The engine client (engine/client.py through AsyncEngine): read-only info built once, a stats snapshot
taken between steps, a request's blocks and a program's KV as plain data, work on the engine's thread."""

from __future__ import annotations

import dataclasses
import threading

import anyio
import pytest

from agentrt.engine import AsyncEngine, SamplingParams
from agentrt.engine.client import EngineInfo
from agentrt.engine.program_ops import StartProgram
from tests.conftest import assert_all_blocks_free

PROMPT = list(range(400, 418))  # 18 tokens: 5 blocks of 4


def test_info_is_built_once_and_read_only(tiny_model_path):
    eng = AsyncEngine(model=str(tiny_model_path), num_blocks=64, block_size=4, max_num_seqs=7)
    try:
        info = eng.info
        assert isinstance(info, EngineInfo) and info.model_name == tiny_model_path.name
        assert (info.num_blocks, info.block_size, info.max_num_seqs) == (64, 4, 7)
        assert info.vocab_size >= len(info.tokenizer)
        assert info.max_model_len > 0 and info.hidden_size > 0 and info.eos_token_ids
        assert not info.lora_enabled and not info.has_score_head and info.has_lm_head
        assert info.pooling_method == "last"
        with pytest.raises(dataclasses.FrozenInstanceError):
            info.max_model_len = 1  # type: ignore[misc]
        with pytest.raises(TypeError):
            info.generation_defaults["temperature"] = 0.0  # type: ignore[index]
    finally:
        eng.close()


def test_stats_during_a_step_wait_for_it_and_request_info_is_plain_data(tiny_model_path):
    async def main():
        async with AsyncEngine(model=str(tiny_model_path), num_blocks=64, block_size=4) as eng:
            eng.program_op(StartProgram("p"))
            stream = eng.add_request(PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                                     request_id="r", program_id="p")
            async for _ in stream:  # the first token: the request runs, the engine steps on
                break
            stats = await eng.stats()
            assert (stats.num_running, stats.num_waiting) == (1, 0)
            assert stats.kv.num_blocks - stats.kv.num_free_blocks >= 5 and stats.tracked["streams"] == 1
            assert stats.running_seats == eng.core.config.max_num_seqs  # FCFS never caps the running set
            info = eng.request_info("r")
            assert info is not None and info.program_id == "p" and len(info.block_ids) >= 5
            assert info.queue_level is None  # FCFS has no levels
            assert eng.program_kv("p").held == len(info.block_ids)
            await stream.result()
            assert eng.request_info("r") is None
            idle = await eng.stats()
            assert (idle.num_running, idle.num_waiting, idle.calls_per_level) == (0, 0, {})
            assert all(v == 0 for v in idle.tracked.values())
            assert_all_blocks_free(eng.core)

    anyio.run(main)


def test_operations_run_on_the_engine_thread_between_steps(tiny_model_path):
    async def main():
        async with AsyncEngine(model=str(tiny_model_path), num_blocks=64, block_size=4) as eng:
            stream = eng.add_request(PROMPT, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
            async for _ in stream:
                break
            ident = await eng._on_engine_thread(threading.get_ident)
            assert ident == eng._thread.ident != threading.get_ident()
            await stream.result()

    anyio.run(main)
