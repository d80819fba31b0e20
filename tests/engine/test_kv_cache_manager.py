"""Exact-state tests of the KV cache manager on a tiny pool (block_size=4, 10 blocks).

Each test drives `KVCacheManager` the way the scheduler does (admit with the cached prefix,
allocate, advance `num_computed_tokens`, `cache_blocks`, free) and checks block ids, ref counts,
the hash index and the free-queue (eviction) order after every operation.
"""

from __future__ import annotations

import pytest

from agentrt.engine.config import EngineConfig
from agentrt.engine.kv_cache_manager import KVCacheManager, hash_block
from agentrt.engine.policy import make_policy
from agentrt.engine.request import Request
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.scheduler import Scheduler

BS = 4


def make_kv(num_blocks: int = 10, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)


def make_req(rid: str, tokens, salt: str | None = None, max_tokens: int = 16) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), cache_salt=salt)


def admit(kv: KVCacheManager, req: Request, num_new: int | None = None) -> int:
    """Admit a waiting request with its cached prefix and compute `num_new` tokens (default: all);
    returns the number of hit tokens."""
    hits, num_hit = kv.get_computed_blocks(req)
    n = req.num_tokens - num_hit if num_new is None else num_new
    assert kv.allocate_slots(req, n, hits)
    req.num_computed_tokens = num_hit + n
    kv.cache_blocks(req)
    return num_hit


def step(kv: KVCacheManager, req: Request, n: int) -> None:
    """One more scheduled chunk of `n` tokens for a running request."""
    assert kv.allocate_slots(req, n)
    req.num_computed_tokens += n
    kv.cache_blocks(req)


def decode(kv: KVCacheManager, req: Request, token: int) -> None:
    """Append a sampled token and compute it (the next decode step)."""
    req.append_token(token)
    step(kv, req, 1)


def hashes_of(kv: KVCacheManager, tokens, n: int, salt: str | None = None) -> list[bytes]:
    return kv.block_hashes(make_req("probe", tokens, salt), n)


def refs(kv: KVCacheManager) -> list[int]:
    return list(kv.pool.ref_cnt)


def free_queue(kv: KVCacheManager) -> list[int]:
    return list(kv.pool.free_queue)


def assert_consistent(kv: KVCacheManager, *live: Request) -> None:
    pool = kv.pool
    expected = [0] * kv.num_blocks
    for r in live:
        for b in r.block_ids:
            expected[b] += 1
    assert pool.ref_cnt == expected
    assert set(pool.free_queue) == {b for b in range(kv.num_blocks) if expected[b] == 0}
    assert {h: b for b, h in enumerate(pool.block_hash) if h is not None} == pool.cached


P10 = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens


# ---- allocate / cache / free ---------------------------------------------------------------


def test_allocate_registers_full_blocks_only():
    kv = make_kv()
    a = make_req("a", P10)
    assert admit(kv, a) == 0
    assert a.block_ids == [0, 1, 2]
    assert refs(kv) == [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert free_queue(kv) == [3, 4, 5, 6, 7, 8, 9]
    h = hashes_of(kv, P10, 2)
    assert kv.pool.cached == {h[0]: 0, h[1]: 1}
    assert kv.pool.block_hash[2] is None
    assert a.num_cached_blocks == 2
    assert_consistent(kv, a)


def test_chunked_prefill_registers_blocks_as_they_fill():
    kv = make_kv()
    a = make_req("a", P10)
    admit(kv, a, num_new=3)
    assert a.block_ids == [0] and kv.pool.cached == {}
    step(kv, a, 3)  # 6 computed: block 0 full
    assert a.block_ids == [0, 1]
    assert kv.pool.cached == {hashes_of(kv, P10, 1)[0]: 0} and a.num_cached_blocks == 1
    step(kv, a, 4)  # 10 computed
    assert a.block_ids == [0, 1, 2] and a.num_cached_blocks == 2
    assert set(kv.pool.cached.values()) == {0, 1}
    assert_consistent(kv, a)


def test_free_puts_tail_first_and_unhashed_blocks_at_the_head():
    kv = make_kv()
    a = make_req("a", P10)
    admit(kv, a)
    kv.free(a)
    # block 2 holds a partial block (no hash, nothing to lose): next victim; then the hashed
    # blocks after the never-used ones, tail (1) before head (0)
    assert free_queue(kv) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]
    assert refs(kv) == [0] * 10
    assert a.block_ids == [] and a.num_cached_blocks == 0
    assert set(kv.pool.cached.values()) == {0, 1}  # hashes survive the free
    assert_consistent(kv)


def test_lru_across_requests_first_freed_first_evicted():
    kv = make_kv()
    a, b = make_req("a", range(8)), make_req("b", range(50, 58))
    admit(kv, a)
    admit(kv, b)
    assert a.block_ids == [0, 1] and b.block_ids == [2, 3]
    kv.free(a)
    kv.free(b)
    assert free_queue(kv) == [4, 5, 6, 7, 8, 9, 1, 0, 3, 2]


def test_allocation_fails_without_side_effects():
    kv = make_kv(num_blocks=3)
    a = make_req("a", range(8))
    admit(kv, a)
    b = make_req("b", range(50, 59))  # needs 3 blocks, 1 free
    before = (refs(kv), free_queue(kv), dict(kv.pool.cached))
    assert not kv.allocate_slots(b, 9)
    assert (refs(kv), free_queue(kv), dict(kv.pool.cached)) == before
    assert b.block_ids == []


# ---- prefix hits ---------------------------------------------------------------------------


def test_hit_reuses_cached_blocks_and_pulls_them_out_of_the_free_queue():
    kv = make_kv()
    a = make_req("a", P10)
    admit(kv, a)
    kv.free(a)
    b = make_req("b", P10[:8] + [7, 7, 7])
    hits, num_hit = kv.get_computed_blocks(b)
    assert (hits, num_hit) == ([0, 1], 8)
    assert kv.allocate_slots(b, 3, hits)
    assert b.block_ids == [0, 1, 2]  # hit blocks, then the head of the free queue
    assert refs(kv)[:3] == [1, 1, 1]
    assert free_queue(kv) == [3, 4, 5, 6, 7, 8, 9]
    assert kv.stats.evictions == 0


def test_hit_on_a_block_in_use_shares_it():
    kv = make_kv()
    a, b = make_req("a", P10), make_req("b", P10[:8] + [1])
    admit(kv, a)
    assert admit(kv, b) == 8
    assert a.block_ids == [0, 1, 2] and b.block_ids == [0, 1, 3]
    assert refs(kv)[:4] == [2, 2, 1, 1]
    assert kv.num_shared_blocks() == 2
    kv.free(a)
    assert refs(kv)[:4] == [1, 1, 0, 1]
    assert free_queue(kv) == [2, 4, 5, 6, 7, 8, 9]  # a's shared blocks are still held by b
    kv.free(b)
    assert free_queue(kv) == [3, 2, 4, 5, 6, 7, 8, 9, 1, 0]
    assert_consistent(kv)


def test_last_prompt_token_is_always_recomputed():
    kv = make_kv()
    a = make_req("a", range(8))  # exactly two full blocks
    admit(kv, a)
    assert len(kv.pool.cached) == 2
    b = make_req("b", range(8))
    assert kv.get_computed_blocks(b) == ([0], 4)  # the second block holds the last token
    c = make_req("c", range(9))
    assert kv.get_computed_blocks(c) == ([0, 1], 8)
    assert kv.get_computed_blocks(make_req("d", range(4))) == ([], 0)


def test_hit_stops_at_the_first_miss():
    kv = make_kv()
    admit(kv, make_req("a", list(range(12)) + [0]))
    other = list(range(4)) + [99, 5, 6, 7] + list(range(8, 12)) + [0]
    assert kv.get_computed_blocks(make_req("b", other)) == ([0], 4)  # same 3rd block, different parent


def test_running_request_gets_no_hits():
    kv = make_kv()
    a = make_req("a", P10)
    admit(kv, a)
    assert kv.get_computed_blocks(a) == ([], 0)


def test_allocation_counts_hit_blocks_in_the_free_queue_as_taken():
    kv = make_kv(num_blocks=4)
    a = make_req("a", range(9))
    admit(kv, a)  # blocks 0, 1 cached, 2 partial
    kv.free(a)
    assert free_queue(kv) == [2, 3, 1, 0]
    b = make_req("b", list(range(8)) + list(range(20, 28)) + [1])  # 2 hits + 9 new tokens = 3 blocks
    hits, num_hit = kv.get_computed_blocks(b)
    assert hits == [0, 1]
    assert not kv.allocate_slots(b, 9, hits)  # 4 free, but 2 of them are the hits themselves
    assert free_queue(kv) == [2, 3, 1, 0] and refs(kv) == [0] * 4
    assert kv.allocate_slots(b, 5, hits)  # a chunk that fits
    assert b.block_ids == [0, 1, 2, 3]
    assert kv.stats.evictions == 0


# ---- eviction ------------------------------------------------------------------------------


def test_eviction_drops_hash_lru_first_and_tails_first():
    kv = make_kv()
    a = make_req("a", P10)
    admit(kv, a)
    kv.free(a)  # queue: [2, 3..9, 1, 0]
    h = hashes_of(kv, P10, 2)
    b = make_req("b", range(200, 236))  # 36 tokens: 9 blocks
    assert kv.allocate_slots(b, 36)
    assert b.block_ids == [2, 3, 4, 5, 6, 7, 8, 9, 1]
    assert kv.stats.evictions == 1
    assert kv.pool.cached == {h[0]: 0} and kv.pool.block_hash[1] is None
    assert free_queue(kv) == [0]
    # the surviving head block still serves a hit
    assert kv.get_computed_blocks(make_req("c", P10)) == ([0], 4)
    assert_consistent(kv, b)


def test_freed_hash_survives_until_its_block_is_reallocated():
    kv = make_kv(num_blocks=3)
    a = make_req("a", range(5))
    admit(kv, a)  # block 0 cached, block 1 partial
    kv.free(a)
    assert free_queue(kv) == [1, 2, 0]
    b = make_req("b", range(50, 57))  # 2 blocks: takes 1 and 2, not the cached 0
    admit(kv, b)
    assert b.block_ids == [1, 2] and kv.stats.evictions == 0
    assert kv.get_computed_blocks(make_req("c", range(5))) == ([0], 4)
    c = make_req("c", range(70, 73))
    assert kv.allocate_slots(c, 3)
    assert c.block_ids == [0] and kv.stats.evictions == 1
    assert kv.get_computed_blocks(make_req("d", range(5))) == ([], 0)


# ---- cache salt ----------------------------------------------------------------------------


def test_salted_requests_do_not_share():
    kv = make_kv()
    admit(kv, make_req("a", P10, salt="tenant-a"))
    assert kv.get_computed_blocks(make_req("b", P10, salt="tenant-b")) == ([], 0)
    assert kv.get_computed_blocks(make_req("c", P10)) == ([], 0)
    assert kv.get_computed_blocks(make_req("d", P10, salt="tenant-a")) == ([0, 1], 8)


def test_salted_identical_prompts_are_not_deduplicated():
    kv = make_kv()
    a, b = make_req("a", P10, salt="x"), make_req("b", P10, salt="y")
    admit(kv, a)
    admit(kv, b)
    assert a.block_ids == [0, 1, 2] and b.block_ids == [3, 4, 5]
    assert kv.stats.dedup_merges == 0 and len(kv.pool.cached) == 4


def test_salt_and_tokens_cannot_run_together_in_the_root_hash():
    """Regression: the root used to be `extra + "12,3,..."`, so salt "x" + [12, ...] and salt
    "x1" + [2, ...] hashed the same and a tenant could hit another tenant's different tokens."""
    kv = make_kv()
    admit(kv, make_req("a", [12, 3, 4, 5, 6], salt="x"))
    assert kv.get_computed_blocks(make_req("b", [2, 3, 4, 5, 6], salt="x1")) == ([], 0)
    admit(kv, make_req("c", [12, 3, 4, 5, 6]))
    assert kv.get_computed_blocks(make_req("d", [2, 3, 4, 5, 6], salt="1")) == ([], 0)
    assert hash_block(None, [1, 2], b"m|") != hash_block(None, [2], b"m|1")


# ---- dedup ---------------------------------------------------------------------------------


def test_concurrent_identical_prefixes_merge_into_one_block():
    kv = make_kv()
    a, b = make_req("a", P10), make_req("b", P10[:8] + [1, 2, 3])
    # both admitted in the same step: neither finds anything cached yet
    for r in (a, b):
        hits, _ = kv.get_computed_blocks(r)
        assert hits == []
        assert kv.allocate_slots(r, r.num_tokens)
    assert a.block_ids == [0, 1, 2] and b.block_ids == [3, 4, 5]
    for r in (a, b):  # update_from_output
        r.num_computed_tokens = r.num_tokens
        kv.cache_blocks(r)
    assert b.block_ids == [0, 1, 5]
    assert refs(kv) == [2, 2, 1, 0, 0, 1, 0, 0, 0, 0]
    assert free_queue(kv) == [4, 3, 6, 7, 8, 9]  # the duplicates are free and unhashed: next victims
    assert kv.stats.dedup_merges == 2
    h = hashes_of(kv, P10, 2)
    assert kv.pool.cached == {h[0]: 0, h[1]: 1}
    assert_consistent(kv, a, b)
    kv.free(a)
    kv.free(b)
    assert_consistent(kv)


def test_dedup_merges_into_a_freed_cached_block():
    kv = make_kv()
    a, b = make_req("a", range(8)), make_req("b", range(9))
    assert kv.allocate_slots(a, 8) and kv.allocate_slots(b, 9)
    a.num_computed_tokens = 8
    kv.cache_blocks(a)
    kv.free(a)  # a's blocks 0, 1 are cached and free
    assert free_queue(kv) == [5, 6, 7, 8, 9, 1, 0]
    b.num_computed_tokens = 9
    kv.cache_blocks(b)
    assert b.block_ids == [0, 1, 4]
    assert free_queue(kv) == [3, 2, 5, 6, 7, 8, 9]
    assert kv.stats.dedup_merges == 2
    assert_consistent(kv, b)


def test_identical_decodes_after_fork_dedup():
    kv = make_kv()
    p = make_req("p", range(6))
    admit(kv, p)
    c = make_req("c", range(6))
    kv.fork(p, c)
    for r in (p, c):  # greedy n>1: both sample the same tokens
        decode(kv, r, 42)
        decode(kv, r, 43)
    # p copied the shared partial block to 2 and filled it; c kept block 1, filled it the same way
    assert p.block_ids == [0, 2] and c.block_ids == [0, 2]
    assert kv.stats.cow_copies == 1 and kv.stats.dedup_merges == 1
    assert refs(kv)[:3] == [2, 0, 2]
    assert free_queue(kv)[0] == 1
    assert_consistent(kv, p, c)


# ---- fork / copy-on-write ------------------------------------------------------------------


def test_fork_shares_every_block():
    kv = make_kv()
    p = make_req("p", range(6))
    admit(kv, p)
    c = make_req("c", range(6))
    kv.fork(p, c)
    assert c.block_ids == [0, 1] and c.num_computed_tokens == 6 and c.num_cached_blocks == 1
    assert refs(kv)[:2] == [2, 2] and kv.num_shared_blocks() == 2
    assert free_queue(kv) == [2, 3, 4, 5, 6, 7, 8, 9]
    with pytest.raises(AssertionError, match="already holds blocks"):
        kv.fork(p, c)


def test_first_write_into_a_shared_partial_block_copies_it():
    kv = make_kv()
    p = make_req("p", range(6))
    admit(kv, p)
    c1, c2 = make_req("c1", range(6)), make_req("c2", range(6))
    kv.fork(p, c1)
    kv.fork(p, c2)
    assert refs(kv)[:2] == [3, 3]
    decode(kv, p, 10)
    assert p.block_ids == [0, 2]
    assert kv.take_pending_copies() == [(1, 2)]
    assert kv.take_pending_copies() == []
    assert refs(kv)[:3] == [3, 2, 1]
    decode(kv, c1, 11)
    assert c1.block_ids == [0, 3] and kv.take_pending_copies() == [(1, 3)]
    decode(kv, c2, 12)  # last holder writes in place
    assert c2.block_ids == [0, 1] and kv.take_pending_copies() == []
    assert refs(kv)[:4] == [3, 1, 1, 1]
    assert kv.stats.cow_copies == 2
    assert free_queue(kv) == [4, 5, 6, 7, 8, 9]
    assert_consistent(kv, p, c1, c2)


def test_distinct_decodes_after_fork_register_distinct_blocks():
    kv = make_kv()
    p = make_req("p", range(6))
    admit(kv, p)
    c = make_req("c", range(6))
    kv.fork(p, c)
    for t in (10, 11):
        decode(kv, p, t)
    for t in (20, 21):
        decode(kv, c, t)
    assert p.block_ids == [0, 2] and c.block_ids == [0, 1]
    assert kv.pool.cached == {
        **dict(zip(hashes_of(kv, [0, 1, 2, 3, 4, 5, 10, 11], 2), [0, 2])),
        hashes_of(kv, [0, 1, 2, 3, 4, 5, 20, 21], 2)[1]: 1,
    }
    assert kv.stats.dedup_merges == 0


def test_fork_at_a_block_boundary_needs_no_copy():
    kv = make_kv()
    p = make_req("p", range(8))
    admit(kv, p)
    c = make_req("c", range(8))
    kv.fork(p, c)
    decode(kv, p, 1)
    decode(kv, c, 2)
    assert p.block_ids == [0, 1, 2] and c.block_ids == [0, 1, 3]
    assert kv.take_pending_copies() == [] and kv.stats.cow_copies == 0
    assert refs(kv)[:4] == [2, 2, 1, 1]


def test_copy_on_write_that_does_not_fit_changes_nothing():
    kv = make_kv(num_blocks=2)
    p = make_req("p", range(6))
    admit(kv, p)
    c = make_req("c", range(6))
    kv.fork(p, c)
    p.append_token(9)
    assert not kv.allocate_slots(p, 1)
    assert p.block_ids == [0, 1] and refs(kv) == [2, 2] and kv.take_pending_copies() == []
    kv.free(c)
    assert refs(kv) == [1, 1]
    assert kv.allocate_slots(p, 1)  # sole holder again: writes in place
    assert p.block_ids == [0, 1] and kv.stats.cow_copies == 0


def test_freeing_a_fork_leaves_the_parent_intact():
    kv = make_kv()
    p = make_req("p", range(6))
    admit(kv, p)
    c = make_req("c", range(6))
    kv.fork(p, c)
    kv.free(p)
    assert refs(kv)[:2] == [1, 1] and c.block_ids == [0, 1]
    decode(kv, c, 3)
    assert c.block_ids == [0, 1] and kv.stats.cow_copies == 0
    kv.free(c)
    assert_consistent(kv)


# ---- preemption ----------------------------------------------------------------------------


def preempt(kv: KVCacheManager, req: Request) -> None:
    kv.free(req)  # as Scheduler._preempt does
    req.num_computed_tokens = 0


def test_preempted_request_keeps_its_full_blocks_cached_and_resumes_from_them():
    kv = make_kv()
    a = make_req("a", range(6))
    admit(kv, a)
    for t in (50, 51, 52, 53):
        decode(kv, a, t)  # 10 tokens, computed 10: blocks 0, 1 full
    a.append_token(54)  # sampled, not yet computed (11 tokens)
    assert a.block_ids == [0, 1, 2]
    preempt(kv, a)
    assert free_queue(kv) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]
    assert len(kv.pool.cached) == 2
    # resumption: prompt + generated tokens, both full blocks hit, 3 tokens recomputed
    assert admit(kv, a) == 8
    assert a.block_ids == [0, 1, 2] and a.num_computed_tokens == 11
    assert_consistent(kv, a)


def test_preempted_request_resumes_partially_after_eviction():
    kv = make_kv(num_blocks=4)
    a = make_req("a", range(13))
    admit(kv, a)  # blocks 0, 1, 2 cached, 3 partial
    preempt(kv, a)
    assert free_queue(kv) == [3, 2, 1, 0]
    b = make_req("b", range(50, 55))  # takes 3 and evicts a's tail block 2
    admit(kv, b)
    assert b.block_ids == [3, 2] and kv.stats.evictions == 1
    assert kv.get_computed_blocks(a) == ([0, 1], 8)


# ---- prefix caching off --------------------------------------------------------------------


def test_caching_disabled_never_hashes_or_hits():
    kv = make_kv(caching=False)
    a = make_req("a", P10)
    admit(kv, a)
    assert kv.pool.cached == {} and a.num_cached_blocks == 0
    kv.free(a)
    assert free_queue(kv) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    b = make_req("b", P10)
    assert admit(kv, b) == 0
    assert kv.stats.evictions == 0 and kv.stats.dedup_merges == 0


# ---- through the scheduler: stats counters, preemption and resumption ----------------------


def make_scheduler(num_blocks: int, **kw) -> Scheduler:
    cfg = EngineConfig(block_size=BS, num_blocks=num_blocks, device="cpu", **kw)
    return Scheduler(cfg, KVCacheManager(num_blocks, BS), make_policy("fcfs"))


def run_step(s: Scheduler, sample: int = 7):
    out = s.schedule()
    s.update_from_output(out, 0.0)
    for r, _ in zip(out.reqs, out.num_tokens):
        if r.num_computed_tokens == r.num_tokens:  # caught up: sample a token
            r.append_token(sample)
    return out


def test_scheduler_counts_prefix_queries_and_hits_once_per_request():
    s = make_scheduler(10)
    a = make_req("a", P10)
    s.add_request(a)
    run_step(s)
    s.finish(a, a.status.FINISHED_STOPPED)
    b = make_req("b", P10[:8] + [5])
    s.add_request(b)
    out = run_step(s)
    assert out.num_tokens == [1]
    assert b.num_prefix_hit_tokens == 8
    assert (s.kv.stats.queries_tokens, s.kv.stats.hit_tokens) == (10 + 9, 8)


def test_scheduler_preemption_keeps_blocks_cached_and_resumption_hits():
    s = make_scheduler(4, max_num_batched_tokens=64)
    a, b = make_req("a", range(7), max_tokens=5), make_req("b", range(50, 57), max_tokens=5)
    s.add_request(a)
    s.add_request(b)
    run_step(s)  # both prefill 7 tokens: 2 blocks each, all 4 in use
    assert a.block_ids == [0, 1] and b.block_ids == [2, 3]
    run_step(s)  # both compute token 8: their second blocks fill and are cached
    assert len(s.kv.pool.cached) == 4 and s.kv.num_free_blocks == 0
    out = run_step(s)  # a's token 9 needs a third block: b is preempted for a
    assert out.preempted == [b] and s.num_preemptions == 1
    assert b.num_computed_tokens == 0 and b.block_ids == [] and b.num_preemptions == 1
    assert a.block_ids == [0, 1, 3]  # b's tail block is evicted first
    assert s.kv.stats.evictions == 1
    assert s.kv.pool.block_hash[2] is not None  # b's first block stays cached
    s.finish(a, a.status.FINISHED_STOPPED)
    num_tokens = b.num_tokens
    out = run_step(s)
    assert out.reqs == [b] and out.num_tokens == [num_tokens - 4]  # 4 tokens served from cache
    assert b.block_ids[0] == 2 and b.num_recomputed_tokens == num_tokens - 4
    assert (s.kv.stats.queries_tokens, s.kv.stats.hit_tokens) == (14, 0)  # resumption is not a new query
