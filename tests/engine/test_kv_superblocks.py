"""Superblocks in the block pool (engine.block_pool, `superblock_blocks` S > 1): exact state on tiny pools, the
property machines of test_kv_properties / test_kv_layer_groups run with superblocks on, and greedy tokens through
the whole engine equal to S = 1's.

A multi-block allocation takes aligned runs of S free blocks, a table grows into the block right after its last;
by default a block leaves LRU order only if it has no hash or LRU would evict it for the same allocation (so no
cached block goes earlier than with S = 1); `runs_evict_early` takes any free run."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant

from agentrt.engine.block_pool import BlockPool, PrefixCacheStats
from agentrt.engine.kv_cache_manager import KVCacheManager
from agentrt.engine.request import Request
from agentrt.engine.sampling_params import SamplingParams
from tests.engine import test_kv_layer_groups as groups
from tests.engine import test_kv_properties as props
from tests.engine.test_kv_cache_manager import admit, decode

BS = 4


def req(rid, n, start=0):
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=64))


def test_prefills_take_aligned_runs_and_decode_grows_into_the_next_block():
    kv = KVCacheManager(12, BS, superblock_blocks=4)
    a, b = req("a", 7), req("b", 10, start=100)
    admit(kv, a)  # 2 blocks: the first run's head
    admit(kv, b)  # 3 blocks: a fresh run, not the rest of a's
    assert a.block_ids == [0, 1] and b.block_ids == [4, 5, 6]
    for t in range(2):  # positions 7, 8: a's third block is the one after its last
        decode(kv, a, t)
    assert a.block_ids == [0, 1, 2]
    for t in range(4):
        decode(kv, a, t)
    assert a.block_ids == [0, 1, 2, 3]
    assert kv.stats.run_blocks == 7
    # with S = 1 the same requests take the LRU free queue's order
    lru = KVCacheManager(12, BS)
    a1, b1 = req("a", 7), req("b", 10, start=100)
    admit(lru, a1)
    admit(lru, b1)
    for t in range(2):
        decode(lru, a1, t)
    assert a1.block_ids == [0, 1, 5] and b1.block_ids == [2, 3, 4] and lru.stats.run_blocks == 0
    for r in (a, b):
        kv.free(r)
    assert kv.num_free_blocks == 12 and kv.pool.ref_cnt == [0] * 12


def test_no_free_run_falls_back_to_lru_order_and_the_trailing_blocks_are_no_run():
    pool = BlockPool(10, PrefixCacheStats(), superblock_blocks=4)  # runs 0-3, 4-7; blocks 8, 9 are no run
    assert pool.allocate(10) == list(range(10))
    pool.release([9, 2, 8, 5])  # no run is whole again
    assert pool.allocate(3) == [5, 8, 2]  # the LRU queue's head (clean blocks are put at the head)
    pool.release([0, 1, 3, 2])  # run 0 is whole again
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1, after=1) == [2]  # the block after the table's last
    assert pool.allocate(1, after=5) == [3]  # block 6 is held: LRU order
    assert pool.allocate(2, after=8) is None  # one block free
    assert pool.allocate(1, after=8) == [9]
    assert pool.allocate(1) is None
    pool.release(range(10))
    assert pool.num_free == 10 and pool.ref_cnt == [0] * 10 and sorted(pool._free_runs) == [(-1, 0), (-1, 1)]


def cached_pool(evict_early: bool) -> BlockPool:
    """8 blocks in runs 0-3 and 4-7, each cached, freed in the order 0, 4, 5, 6, 7, 1, 2, 3: run 1 is whole at
    the 5th release (its newest cached block, 7, freed 5th), run 0 at the 8th."""
    pool = BlockPool(8, PrefixCacheStats(), superblock_blocks=4, runs_evict_early=evict_early)
    pool.allocate(8)
    for b in range(8):
        pool.register(b, bytes([b]))
    pool.release([0, 4, 5, 6, 7, 1, 2, 3])
    assert list(pool.free_queue) == [0, 4, 5, 6, 7, 1, 2, 3] and pool.stats.run_blocks == 8
    pool.stats.run_blocks = 0
    return pool


def test_a_run_never_takes_a_cached_block_lru_would_keep():
    pool = cached_pool(False)
    # 4 blocks: LRU would evict 0, 4, 5, 6 and keep 7; run 1 holds 7: not taken, LRU order instead
    assert pool.allocate(4) == [0, 4, 5, 6]
    assert sorted(pool.cached.values()) == [1, 2, 3, 7] and pool.stats.evictions == 4
    pool = cached_pool(False)
    # 5 blocks: LRU evicts 0, 4, 5, 6, 7 anyway: run 1 whole, then the LRU head
    assert pool.allocate(5) == [4, 5, 6, 7, 0]
    assert sorted(pool.cached.values()) == [1, 2, 3]
    pool = cached_pool(False)
    assert pool.allocate(1) == [0]  # one block, no table: LRU's head
    # a table ending at block 0 grows into block 1 only when LRU would evict block 1 for the same allocation
    assert pool.allocate(1, after=0) == [4]
    pool.release([4])  # back at the head, clean
    assert pool.allocate(5, after=0) == [1, 4, 5, 6, 7]  # LRU: 4, 5, 6, 7, 1; the run after the table's next
    assert sorted(pool.cached.values()) == [2, 3] and pool.stats.run_blocks == 5


def test_runs_evict_early_takes_the_oldest_whole_run_whatever_it_holds():
    pool = cached_pool(True)
    assert pool.allocate(4) == [4, 5, 6, 7]  # block 7's hash goes before LRU's turn; block 0's stays
    assert sorted(pool.cached.values()) == [0, 1, 2, 3] and pool.stats.run_blocks == 4
    pool = cached_pool(True)
    assert pool.allocate(1) == [0]
    assert pool.allocate(1, after=0) == [1]  # cached, and LRU's next victim is 4: taken anyway
    assert sorted(pool.cached.values()) == [2, 3, 4, 5, 6, 7]


def test_forgetting_cached_blocks_makes_their_runs_clean():
    pool = cached_pool(False)
    assert pool.drop_unused_cached() == 0
    assert sorted(pool._free_runs) == [(-1, 0), (-1, 1)]
    assert pool.allocate(4) == [0, 1, 2, 3]  # both runs clean: the lower one first


@pytest.mark.parametrize("bad", [0, 3, 6, -4, True, 2.0])
def test_superblock_size_must_be_a_power_of_two(bad):
    with pytest.raises(ValueError, match=f"superblock_blocks must be a power of two >= 1, got {bad!r}"):
        BlockPool(8, PrefixCacheStats(), superblock_blocks=bad)
    from agentrt.engine.config import EngineConfig

    with pytest.raises(ValueError, match=f"kv_superblock_blocks must be a power of two >= 1, got {bad!r}"):
        EngineConfig(kv_superblock_blocks=bad, device="cpu")


def test_cli_flag_sets_the_engine_field():
    import argparse

    from agentrt._cli_options import add_engine_options, engine_options

    p = argparse.ArgumentParser()
    add_engine_options(p)
    assert engine_options(p.parse_args(["--kv-superblock-blocks", "16"]))["kv_superblock_blocks"] == 16
    assert "kv_superblock_blocks" not in engine_options(p.parse_args([]))


# ---- the property machines with superblocks on ------------------------------------------------------------
def check_runs(pool: BlockPool) -> None:
    """The run index matches the free queue: free counts per run, a live heap entry per whole free run, its age
    the newest free time of its cached blocks."""
    S = pool.superblock_blocks
    free = set(pool.free_queue)
    live = {(a, s) for a, s in pool._free_runs if pool._run_free[s] == S and pool._run_age[s] == a}
    for s in range(pool._num_runs):
        blocks = range(s * S, s * S + S)
        assert pool._run_free[s] == sum(b in free for b in blocks), s
        if pool._run_free[s] == S:
            age = max((pool._freed_at[b] for b in blocks if pool.block_hash[b] is not None), default=-1)
            assert (age, s) in live, (s, age, pool._free_runs)
    cached = [pool._freed_at[b] for b in pool.free_queue if pool.block_hash[b] is not None]
    assert cached == sorted(cached), "cached free blocks out of LRU order"


def guard_lru(kv: KVCacheManager) -> None:
    """Wrap the pool's allocate: the hashes it drops are exactly those LRU would drop for the same allocation (the
    clean blocks sit at the queue's head: a window of n holding a cached block holds every clean one, so the
    blocks a run may take are the window's)."""
    pool = kv.pool
    allocate = pool.allocate

    def checked(n, owner=None, after=None):
        lru = {pool.block_hash[b] for b in list(pool.free_queue)[:n]} - {None}
        before = set(pool.cached)
        out = allocate(n, owner, after)
        assert before - set(pool.cached) == lru, "a superblock evicted other cached blocks than LRU would"
        return out

    pool.allocate = checked


class SuperblockKVMachine(props.KVMachine):
    """test_kv_properties' machine (6 blocks) with runs of 2 blocks, cached blocks evicted in LRU's turn only."""

    S, EARLY = 2, False

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(props.NUM_BLOCKS, props.BS, superblock_blocks=self.S, runs_evict_early=self.EARLY)
        if not self.EARLY:
            guard_lru(self.kv)

    @invariant()
    def run_index_matches_the_free_queue(self):
        check_runs(self.kv.pool)


class EarlySuperblockKVMachine(SuperblockKVMachine):
    """Runs of 4 (one run and two blocks that are none), any free run taken."""

    S, EARLY = 4, True


class GroupedSuperblockKVMachine(groups.GroupedKVMachine):
    """test_kv_layer_groups' machine (a full group, two window groups, 14 blocks) with runs of 4."""

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(self.NUM, props.BS, layout=self.LAYOUT, superblock_blocks=4)
        guard_lru(self.kv)

    @invariant()
    def run_index_matches_the_free_queue(self):
        check_runs(self.kv.pool)


_SETTINGS = settings(max_examples=100, stateful_step_count=50, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestSuperblockKV = SuperblockKVMachine.TestCase
TestSuperblockKV.settings = _SETTINGS
TestEarlySuperblockKV = EarlySuperblockKVMachine.TestCase
TestEarlySuperblockKV.settings = _SETTINGS
TestGroupedSuperblockKV = GroupedSuperblockKVMachine.TestCase
TestGroupedSuperblockKV.settings = _SETTINGS


# ---- the whole engine ----------------------------------------------------------------------------------------
def test_greedy_tokens_equal_with_and_without_superblocks(tiny_model_path):
    """Three conversations of three turns at once on a small pool (evictions, chunked prefill): the same greedy
    tokens with runs of 4 and 16 as with S = 1, blocks handed out in runs, every block free after."""
    from agentrt.engine import LLM
    from tests.conftest import assert_all_blocks_free

    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    replies = {}
    for s in (1, 4, 16):
        llm = LLM(str(tiny_model_path), num_blocks=40, block_size=4, max_num_batched_tokens=32, max_num_seqs=3,
                  kv_superblock_blocks=s)
        convs = [[3 + (7 * i + 13 * j) % 400 for j in range(30 + 9 * i)] for i in range(3)]
        got = []
        for turn in range(3):
            outs = llm.generate([{"prompt_token_ids": c} for c in convs], greedy)
            got.append([o.token_ids for o in outs])
            convs = [c + o.token_ids + [5 + turn] * 11 for c, o in zip(convs, outs)]
        assert_all_blocks_free(llm.core)
        assert (llm.core.kv.stats.run_blocks > 0) == (s > 1)
        assert llm.core.kv.stats.evictions > 0  # the pool is small enough for the allocation to meet the cache
        replies[s] = got
    assert replies[4] == replies[1] and replies[16] == replies[1]


def test_greedy_tokens_equal_with_superblocks_on_window_groups(tmp_path):
    """Gemma 3's layer rules (a full group and window groups freeing blocks all along) on a tiny seeded checkpoint:
    the same greedy tokens with runs of 4 as with S = 1, every block free after."""
    import os

    from agentrt.engine import LLM
    from agentrt.engine.loader import load_tokenizer, resolve_model
    from tests.conftest import assert_all_blocks_free
    from tests.engine.test_kv_layer_groups_engine import GREEDY, _tokens, gemma3_config
    from tests.engine.test_moe_models import make_hf

    make_hf(gemma3_config(), seed=5).save_pretrained(tmp_path)
    load_tokenizer(resolve_model(os.environ.get("AGENTRT_TEST_TOKENIZER"))).save_pretrained(tmp_path)
    replies = {}
    for s in (1, 4):
        llm = LLM(str(tmp_path), num_blocks=200, block_size=4, max_num_batched_tokens=32, max_num_seqs=3,
                  kv_superblock_blocks=s)
        assert len(llm.core.kv_layout.groups) > 1
        convs = [_tokens(30 + 7 * i, i) for i in range(3)]
        got = []
        for _turn in range(3):
            outs = llm.generate([{"prompt_token_ids": c} for c in convs], GREEDY)
            got.append([o.token_ids for o in outs])
            convs = [c + o.token_ids + _tokens(9, len(c)) for c, o in zip(convs, outs)]
        assert_all_blocks_free(llm.core)
        assert (llm.core.kv.stats.run_blocks > 0) == (s > 1)
        replies[s] = got
    assert replies[4] == replies[1]
