"""`agentrt bench paging`'s pure helpers (prefix-hit counting as the KV manager would serve the calls, KV bytes per
stored token, the old and new step tables agreeing) and a smoke run that leaves the benchmark pages alone."""

from __future__ import annotations

import json

import pytest
import torch

from agentrt.bench import paging as bench
from tests.benchpages import pages


def test_prefix_hits_counts_whole_cached_blocks_of_the_prompt():
    first = list(range(100, 110))  # 10 tokens
    reply = [7, 8, 9]  # computed but its last token: 12 tokens, 3 full blocks of 4 cached
    second = first + reply + [1, 2]  # 15 tokens: at most (15 - 1) // 4 = 3 blocks, all cached
    other = [5, *first[1:]]  # another first token: nothing in common
    assert bench.prefix_hits([(first, reply)], 4) == (0, 10)
    assert bench.prefix_hits([(first, reply), (second, [3])], 4) == (12, 25)
    assert bench.prefix_hits([(first, reply), (second, [3]), (other, [1])], 4) == (12, 35)
    assert bench.prefix_hits([(first, reply), (first, reply)], 4) == (8, 20)  # the last prompt token is computed
    assert bench.prefix_hits([(first, reply), (second, [3])], 8) == (8, 25)  # one block of 8 is full
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        bench.prefix_hits([], 0)


def test_prefix_hits_are_what_the_kv_manager_serves():
    """The agent workload's calls through a KVCacheManager large enough to evict nothing: the same hit tokens."""
    from agentrt.bench import workload
    from agentrt.engine.kv_cache_manager import KVCacheManager
    from agentrt.engine.request import Request
    from agentrt.engine.sampling_params import SamplingParams

    specs = workload.make_agent_workload(3, 1.0, seed=2, mix=workload.AGENT_WAIT_MIX)
    calls = [c for s in specs for c in bench.program_calls(s)][:40]
    for bs in (16, 64):
        kv = KVCacheManager(num_blocks=4096, block_size=bs)
        hit = 0
        for i, (prompt, reply) in enumerate(calls):
            req = Request(f"c{i}", prompt, SamplingParams(max_tokens=len(reply)))
            hits, n = kv.get_computed_blocks(req)
            assert kv.allocate_slots(req, len(prompt) - n, hits)
            req.num_computed_tokens = len(prompt)
            for t in reply:
                req.append_token(t)
            assert kv.allocate_slots(req, len(reply) - 1)
            req.num_computed_tokens += len(reply) - 1
            kv.cache_blocks(req)
            kv.free(req)
            hit += n
        assert kv.stats.evictions == 0
        assert bench.prefix_hits(calls, bs, f"|{req.cache_key}".encode()) == (hit, sum(len(p) for p, _ in calls))
        assert hit > 0


def test_kv_bytes_per_token_rounds_each_sequence_up_to_whole_blocks():
    assert bench.kv_bytes_per_token([1, 16, 17], 16, bytes_per_position=34) == 64  # 64 slots held for 34 tokens
    assert bench.kv_bytes_per_token([32], 16, bytes_per_position=10) == 10
    with pytest.raises(ValueError, match="need sequences of at least one token"):
        bench.kv_bytes_per_token([], 16)


def test_memory_floor_times_both_orders_of_the_same_blocks(monkeypatch):
    monkeypatch.setattr(bench, "MIN_TIME_S", 0.0)
    q, k, v, contiguous, shuffled = bench._decode(2, 64, 16, torch.float32)
    ts, tc = bench.memory_floor(k, v, shuffled, contiguous, 3)
    assert len(ts) == len(tc) == 3 and min(ts) > 0 and min(tc) > 0


def test_the_new_step_tables_equal_the_old_per_request_ones():
    bench.check_equal(num_seqs=5, context=70, block_size=4, steps=30)


def test_program_calls_follow_the_plan():
    from agentrt.bench import workload

    (spec,) = workload.make_agent_workload(1, 1.0, seed=0, mix={"react_few": 1.0})
    calls = bench.program_calls(spec)
    assert 2 <= len(calls) <= 4 and all(len(r) == workload.REACT_FEW["max_tokens"] for _, r in calls)
    for (p, r), (nxt, _) in zip(calls, calls[1:]):
        assert nxt[: len(p) + len(r)] == p + r  # each call's prompt extends the last call's prompt and reply


def test_bench_paging_smoke(capsys, monkeypatch):
    monkeypatch.setattr(bench, "MIN_TIME_S", 0.0)
    before = pages()
    argv = ["--cases", "2x64", "--sweep-case", "2x64", "--block-sizes", "16,32", "--repeats", "1",
            "--prep-steps", "12", "--superblocks", "", "--json"]  # (the superblock sweep: its own test below)
    assert bench.main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    kinds = ["4 KB", "2 MB"] if bench.huge_pages.supported() else ["4 KB"]
    assert [(r["pages"], r["dtype"], r["batch"], r["context"]) for r in res["decode"]] == [
        (k, d, 2, 64) for k in kinds for d in ("float32", "bfloat16")]
    assert all(r["shuffled_ms"] > 0 and r["shuffled_over_contiguous"] > 0 and r["floor_ratio"] > 0 for r in res["decode"])
    assert [r["block_size"] for r in res["block_size_kernel"]] == [16, 32, 16, 32]
    w = res["block_size_workload"]
    assert len(w) == 2 * len(bench.AGENT_SETS) and all(0 < r["hit_rate"] < 1 and r["waste"] >= 0 for r in w)
    assert res["host_prep"]["old_us"] > 0 and res["host_prep"]["new_us"] > 0
    assert res["tiers_in_place"] == bench.TIERS_IN_PLACE and "--configs t1-copy,t1" in bench.TIERS_IN_PLACE["command"]
    text = bench.markdown(res)
    assert "Largest gap" in text and "Measured by `agentrt bench tiers --configs t1-copy,t1" in text
    assert pages() == before


@pytest.mark.parametrize("argv", [["--cases", "2x"], ["--cases", "0x64"], ["--block-sizes", "a"],
                                  ["--block-sizes", "0"], ["--repeats", "0"], ["--threads", "0"],
                                  ["--superblocks", "3"], ["--superblocks", "a"], ["--pool-fraction", "0"]])
def test_bench_paging_refuses_bad_arguments(argv):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2


# ---- the superblock sweep -----------------------------------------------------------------------------------
def _small_programs(n=3, seed=2):
    from agentrt.bench import workload

    specs = workload.make_agent_workload(n, 1.0, seed=seed, mix=workload.AGENT_WAIT_MIX)
    return [bench.program_calls(s) for s in specs]


def test_replay_without_eviction_hits_what_prefix_hits_counts_whatever_the_superblocks():
    from agentrt.bench import kv_replay
    from agentrt.engine.request import Request
    from agentrt.engine.sampling_params import SamplingParams

    calls = max(_small_programs(), key=len)  # one program: its calls one after another
    want, total = bench.prefix_hits(calls, 16, f"|{Request('x', [1], SamplingParams()).cache_key}".encode())
    for s in (1, 4, 16):
        st = kv_replay.replay([calls], 4096, 16, s, chunk_tokens=100)
        assert (st.hit_tokens, st.prompt_tokens, st.calls) == (want, total, len(calls))
        assert st.evictions == st.preemptions == 0
        assert (st.run_blocks > 0) == (s > 1)
    early = kv_replay.replay([calls], 4096, 16, 16, True, chunk_tokens=100)  # runs taken whatever they hold
    assert early.hit_tokens <= want and early.prompt_tokens == total and early.evictions > 0


def test_replay_on_a_bounded_pool_accounts_for_every_call_and_runs_make_tables_contiguous():
    from agentrt.bench import kv_replay

    programs = _small_programs(6)
    n = kv_replay.pool_blocks(programs, 16, 0.3)
    one, sixteen = (kv_replay.replay(programs, n, 16, s) for s in (1, 16))
    for st in (one, sixteen):  # (the replay checks that every block is free at its end)
        assert st.calls == sum(map(len, programs)) and st.prompt_tokens == sum(len(p) for c in programs for p, _ in c)
        assert st.evictions > 0 and 0 < st.hit_rate < 1 and st.snapshot
        assert st.kv_bytes_per_token(1) >= 0.9  # whole blocks: at least about a position's bytes a token
    assert sixteen.contiguous_fraction > one.contiguous_fraction and sixteen.mean_run_blocks > one.mean_run_blocks


def test_table_contiguity_and_pool_size_are_exact():
    from agentrt.bench import kv_replay

    st = kv_replay.ReplayStats(4, False, 64, 16)
    kv_replay._count_table(st, [4, 5, 6, 9, 10, 2])
    st.calls = 1
    assert (st.table_entries, st.adjacent_entries, st.table_runs) == (5, 3, 3)
    assert st.contiguous_fraction == 0.6 and st.mean_run_blocks == 2.0
    programs = [[([1] * 20, [2] * 12)], [([1] * 100, [2]), ([1] * 40, [2] * 9)]]  # longest calls: 2 and 7 blocks
    assert kv_replay.pool_blocks(programs, 16, 0.5) == 8  # the longest call alone + 1
    assert kv_replay.pool_blocks(programs, 16, 2.0) == 18
    with pytest.raises(ValueError, match="needs 7 blocks; the pool has 6"):
        kv_replay.replay(programs, 6)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1, got 0"):
        kv_replay.replay(programs, 60, chunk_tokens=0)


def test_superblock_sweep_rows_and_table(monkeypatch):
    monkeypatch.setattr(bench, "MIN_TIME_S", 0.0)
    monkeypatch.setattr(bench, "AGENT_SETS", {"small mix": ("wait", 4)})
    rows = bench.superblock_sweep([1, 4], seed=0, repeats=1, fraction=0.4)
    assert [(r["superblock_blocks"], r["evict_early"]) for r in rows] == [(1, False), (4, False), (4, True)]
    for r in rows:
        assert 0 < r["hit_rate"] < 1 and r["snapshot_blocks"] > 0 and r["num_blocks"] == rows[0]["num_blocks"]
        assert [k["dtype"] for k in r["kernel"]] == ["float32", "bfloat16"]
        assert all(k["replay_ms"] > 0 and k["contiguous_ms"] > 0 and k["shuffled_ms"] > 0 for k in r["kernel"])
    text = "\n".join(bench.superblock_markdown(rows))
    assert "### Superblocks" in text and "LRU-bounded" in text and "early" in text and "small mix" in text
    assert bench.superblock_sweep([], seed=0, repeats=1) == [] and bench.superblock_markdown([]) == []


def test_superblock_kernel_reads_shared_blocks_and_refuses_empty_tables(monkeypatch):
    monkeypatch.setattr(bench, "MIN_TIME_S", 0.0)
    rows = bench.superblock_kernel([[0, 1, 2], [0, 1, 5, 6]], 6, 16, repeats=1)  # 7 entries in a pool of 6
    assert len(rows) == 2 and all(r["replay_over_contiguous"] > 0 for r in rows)
    with pytest.raises(ValueError, match="need block tables of at least one block"):
        bench.superblock_kernel([[1], []], 6, 16, repeats=1)
