"""Exact-state tests of per-program KV: owners, reservations, pins, expiry, give-way order under
pressure, no deadlock, everything free after the programs end (block_size=4, tiny pools).

Program operations go in as the engine applies them (`KVCacheManager.program_op` with the engine
clock's `now`, or `Scheduler.program_op` on the scheduler's clock).
"""

from __future__ import annotations

import pytest

from agentrt.engine.block_pool import BlockPool
from agentrt.engine.config import EngineConfig
from agentrt.engine.kv_cache_manager import KVCacheManager
from agentrt.engine.policy import make_policy
from agentrt.engine.program_ops import EndProgram, Pin, Release, Reserve, StartProgram
from agentrt.engine.request import Request, RequestStatus
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.scheduler import Scheduler

BS = 4


def make_req(rid: str, tokens, program: str | None, max_tokens: int = 16) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), program_id=program)


def admit(kv: KVCacheManager, req: Request, reserved: bool = False) -> int:
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits, may_take_reserved=reserved)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    kv.admitted(req, num_hit)
    return num_hit


def free_queue(kv: KVCacheManager) -> list[int]:
    return list(kv.pool.free_queue)


def check(kv: KVCacheManager, reqs=()) -> None:
    """The pool's invariants (engine.block_pool), given the live requests."""
    pool: BlockPool = kv.pool
    holders = [0] * len(pool.ref_cnt)  # (in-place ids of a host tier after the pool's own, engine.block_pool)
    for r in reqs:
        for b in r.block_ids:
            holders[b] += 1
    for o in kv.owners.values():
        for b in o.pin:
            holders[b] += 1
    assert pool.ref_cnt == holders
    assert set(pool.free_queue) == {b for b in range(pool.num_blocks) if pool.ref_cnt[b] == 0}
    held: dict[str, int] = {}
    for b in range(pool.num_blocks):
        if pool.ref_cnt[b] == 0:
            assert pool.owner[b] is None and pool.reserved_by[b] is None
        elif pool.owner[b] is not None:
            held[pool.owner[b]] = held.get(pool.owner[b], 0) + 1
    assert dict(pool.held) == held
    for pid, r in pool.reservations.items():
        assert r.blocks == {b for b in range(pool.num_blocks) if pool.reserved_by[b] == pid}
        assert r.used <= r.size
    assert pool.unused_reserved() == sum(r.unused for r in pool.reservations.values())
    assert pool.num_free >= pool.unused_reserved()
    assert set(kv._pinned) == {pid for pid, o in kv.owners.items() if o.pin}


# ---- reservations --------------------------------------------------------------------------


def test_reservation_is_drawn_first_and_kept_from_others():
    kv = KVCacheManager(10, BS)
    kv.program_op(Reserve("p", 12), now=0.0)  # 3 blocks
    assert kv.owner_kv("p").reserved == 3 and kv.pool.available_to("q") == 7 and kv.pool.available_to("p") == 10
    a = make_req("a", range(6), "p")
    admit(kv, a)
    assert a.block_ids == [0, 1] and kv.pool.reservations["p"].blocks == {0, 1}
    assert kv.owner_kv("p").reserved_used == 2 and kv.pool.available_to("q") == 7
    big = make_req("big", range(100, 129), "q")  # 8 blocks: fits only with p's unused block
    hits, _ = kv.get_computed_blocks(big)
    assert not kv.allocate_slots(big, 29, hits)
    assert big.block_ids == [] and kv.num_free_blocks == 8  # nothing changed
    assert kv.allocate_slots(big, 29, hits, may_take_reserved=True)  # give way (a running request, say)
    assert kv.owner_kv("p").reserved == 2 and kv.retention.reserved_blocks_given_way == 1
    check(kv, [a, big])
    kv.free(a)
    assert kv.owner_kv("p").reserved_used == 0 and kv.pool.unused_reserved("p") == 2
    check(kv, [big])
    kv.free(big)
    kv.program_op(EndProgram("p"), now=1.0)
    assert kv.num_free_blocks == 10 and not kv.pool.reservations and not kv.pool.held
    check(kv)


def test_reservations_are_capped_in_total_and_by_what_is_free():
    kv = KVCacheManager(10, BS, max_reserved_fraction=0.5)  # at most 5 blocks reserved in all
    kv.program_op(Reserve("p", 4 * BS), now=0.0)
    kv.program_op(Reserve("q", 4 * BS), now=0.0)
    assert (kv.owner_kv("p").reserved, kv.owner_kv("q").reserved) == (4, 1)
    kv.program_op(Reserve("p", 0), now=0.0)
    assert "p" not in kv.pool.reservations
    a = make_req("a", range(33), "x")  # 9 blocks: only one is left unreserved by anyone else
    admit(kv, a, reserved=True)
    kv.program_op(Reserve("r", 3 * BS), now=0.0)
    assert kv.owner_kv("r").reserved == 0  # nothing free to set aside
    check(kv, [a])
    with pytest.raises(ValueError, match="num_tokens"):
        Reserve("p", -1)


def test_a_dedup_merge_moves_the_reservation_tag_to_the_cached_block():
    kv = KVCacheManager(10, BS)
    a = make_req("a", range(8), None)
    admit(kv, a)
    kv.free(a)  # blocks 0 and 1 stay cached, at the free queue's tail
    kv.program_op(Reserve("p", 2 * BS), now=0.0)
    kv.program_op(Reserve("q", 3 * BS), now=0.0)
    x = make_req("x", range(100, 120), None)
    admit(kv, x)  # every unreserved clean block: free == unused reserved == 5
    assert x.block_ids == [2, 3, 4, 5, 6] and kv.num_free_blocks == kv.pool.unused_reserved() == 5
    b = make_req("b", range(8), "p")  # hits block 0; its second block is computed into 7, then merged into 1
    assert admit(kv, b) == 4
    assert b.block_ids == [0, 1] and kv.stats.dedup_merges == 1
    assert kv.pool.reservations["p"].blocks == {0, 1} and kv.pool.reserved_by[7] is None
    assert kv.num_free_blocks == kv.pool.unused_reserved() == 3
    assert kv.pool.available_to("q") == 3  # q can still draw its whole reservation
    check(kv, [x, b])


# ---- pins ----------------------------------------------------------------------------------


def test_pin_keeps_full_blocks_until_the_next_call_hits_them():
    kv = KVCacheManager(10, BS)
    kv.program_op(Pin("p", 5.0), now=0.0)
    a = make_req("a", range(9), "p")
    admit(kv, a)
    assert a.block_ids == [0, 1, 2]
    kv.free(a, now=1.0)
    assert kv.owners["p"].pin == {0: None, 1: None} and kv.owners["p"].deadline == 6.0
    assert kv.pool.ref_cnt[:3] == [1, 1, 0] and free_queue(kv) == [2, 3, 4, 5, 6, 7, 8, 9]
    assert kv.owner_kv("p").pinned == 2 and kv.num_pinned_blocks == 2
    check(kv)
    for i in range(3):  # other traffic cycles the whole free queue: LRU alone would have lost a's prefix
        other = make_req(f"o{i}", range(100 + 40 * i, 132 + 40 * i), "q")
        admit(kv, other)
        assert 0 not in other.block_ids and 1 not in other.block_ids
        kv.free(other)
    b = make_req("b", list(range(9)) + [50, 51, 52, 53], "p")
    assert admit(kv, b) == 8
    assert b.block_ids[:2] == [0, 1]
    assert kv.owners["p"].pin == {} and kv.retention.ttl_hits == 1 and kv.owner_kv("p").ttl_hits == 1
    assert kv.owner_kv("p").recomputed_prefill_tokens == 1  # a's 9th token sat in a partial block: never cached
    check(kv, [b])


def test_expiry_waits_for_a_waiting_call_then_releases_tail_first():
    kv = KVCacheManager(10, BS)
    kv.program_op(Pin("p", 5.0), now=0.0)
    a = make_req("a", range(12), "p")
    admit(kv, a)
    kv.free(a, now=0.0)
    assert list(kv.owners["p"].pin) == [0, 1, 2]
    kv.expire_pins(4.9, set())
    assert kv.owner_kv("p").pinned == 3
    kv.expire_pins(5.0, {"p"})  # the program is waiting again: keep
    assert kv.owner_kv("p").pinned == 3
    kv.expire_pins(5.0, {"q"})
    assert kv.owner_kv("p").pinned == 0 and kv.retention.expiries == 1
    assert free_queue(kv)[-3:] == [2, 1, 0]  # tail first: the deepest block is evicted first
    b = make_req("b", range(14), "p")
    admit(kv, b)  # its blocks were still cached (nothing reused them) but the pin had gone: a miss
    assert kv.retention.ttl_misses == 1 and kv.retention.ttl_hits == 0
    check(kv, [b])


def test_release_and_pin_zero_drop_pins_at_once_and_stop_pinning():
    kv = KVCacheManager(10, BS)
    kv.program_op(Pin("p", 5.0), now=0.0)
    a = make_req("a", range(8), "p")
    admit(kv, a)
    kv.free(a, now=0.0)
    kv.program_op(Pin("p", 2.0), now=1.0)  # a new TTL moves the deadline
    assert kv.owners["p"].deadline == 3.0
    kv.program_op(Release("p"), now=1.0)
    assert kv.owner_kv("p").pinned == 0 and kv.owner_kv("p").ttl_s == 0.0
    b = make_req("b", range(8), "p")
    admit(kv, b)
    kv.free(b, now=2.0)
    assert kv.owner_kv("p").pinned == 0
    with pytest.raises(ValueError, match="ttl_s"):
        Pin("p", float("inf"))
    check(kv)


def test_pins_give_way_latest_program_first_from_their_tails():
    kv = KVCacheManager(10, BS)
    for pid, base in (("old", 0), ("new", 100)):
        kv.program_op(Pin(pid, 60.0), now=0.0)
        r = make_req(pid, range(base, base + 12), pid)
        admit(kv, r)
        kv.free(r, now=0.0)
    assert list(kv.owners["old"].pin) == [0, 1, 2] and list(kv.owners["new"].pin) == [3, 4, 5]
    c = make_req("c", range(200, 221), "c")  # 6 blocks, 4 free: two pinned blocks must give way
    admit(kv, c)
    assert list(kv.owners["new"].pin) == [3] and list(kv.owners["old"].pin) == [0, 1, 2]
    assert kv.retention.pin_blocks_given_way == 2
    assert sorted(c.block_ids) == [4, 5, 6, 7, 8, 9]
    d = make_req("d", range(300, 309), "d")  # 3 blocks, none free: new's last, then old's tail
    admit(kv, d)
    assert not kv.owners["new"].pin and list(kv.owners["old"].pin) == [0]
    check(kv, [c, d])
    assert kv.num_allocatable("e") == 1  # old's last pinned block
    e = make_req("e", range(400, 409), "e")
    hits, _ = kv.get_computed_blocks(e)
    assert not kv.allocate_slots(e, 9, hits)  # 3 blocks: more than pins can give; nothing changed
    assert list(kv.owners["old"].pin) == [0]
    check(kv, [c, d])


def test_a_pin_shared_with_a_running_request_frees_nothing_and_is_skipped():
    kv = KVCacheManager(6, BS)
    kv.program_op(Pin("p", 60.0), now=0.0)
    a = make_req("a", range(8), "p")
    admit(kv, a)
    kv.free(a, now=0.0)
    q = make_req("q", list(range(8)) + [9], "q")  # shares p's pinned prefix
    assert admit(kv, q) == 8
    assert kv.num_allocatable("x") == 3  # p's pinned blocks are held by q too: unpinning frees nothing
    x = make_req("x", range(100, 113), "x")
    hits, _ = kv.get_computed_blocks(x)
    assert not kv.allocate_slots(x, 13, hits)
    assert list(kv.owners["p"].pin) == [0, 1]
    check(kv, [q])


# ---- through the scheduler: no deadlock, everything back at the end -----------------------


def make_scheduler(num_blocks: int, clock, **kw) -> Scheduler:
    cfg = EngineConfig(block_size=BS, num_blocks=num_blocks, device="cpu", **kw)
    return Scheduler(cfg, KVCacheManager(num_blocks, BS), make_policy("fcfs"), clock=clock)


def run_step(s: Scheduler):
    out = s.schedule()
    s.update_from_output(out, 0.01)
    for r in out.reqs:
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(7)
            if r.num_output_tokens >= r.sampling.max_tokens:
                s.finish(r, RequestStatus.FINISHED_LENGTH)
    return out


def test_no_deadlock_when_pins_and_reservations_fill_the_cache():
    now = [0.0]
    s = make_scheduler(8, lambda: now[0], max_num_batched_tokens=64)
    s.program_op(Reserve("r", 4 * BS))  # 4 blocks set aside, for a program that never calls
    s.program_op(Pin("p", 1000.0))
    a = make_req("a", range(16), "p", max_tokens=1)
    s.add_request(a)
    while s.has_work():
        run_step(s)
    assert s.kv.owner_kv("p").pinned == 4 and s.kv.num_free_blocks == 4 and s.kv.pool.available_to("q") == 0
    q = make_req("q", range(100, 120), "q", max_tokens=4)  # 6 blocks: pins and the reservation must yield
    s.add_request(q)
    for _ in range(20):
        if q.finished:
            break
        run_step(s)
    assert q.status == RequestStatus.FINISHED_LENGTH and q.num_preemptions == 0
    assert s.kv.retention.pin_blocks_given_way >= 2 and s.kv.retention.reserved_blocks_given_way >= 1
    for pid in ("p", "r", "q"):
        s.program_op(EndProgram(pid))
    assert s.kv.num_free_blocks == 8 and not s.kv.owners and not s.kv.pool.reservations and not s.kv.pool.held
    check(s.kv)


def test_pins_expire_on_the_scheduler_clock_unless_the_program_waits():
    now = [0.0]
    s = make_scheduler(10, lambda: now[0])
    s.program_op(StartProgram("p"))
    s.program_op(Pin("p", 2.0))
    a = make_req("a", range(8), "p", max_tokens=1)
    s.add_request(a)
    run_step(s)
    assert a.finished and s.kv.owner_kv("p").pinned == 2 and s.kv.owners["p"].deadline == 2.0
    now[0] = 1.9
    s.schedule()
    assert s.kv.owner_kv("p").pinned == 2
    now[0] = 2.0
    s.schedule()
    assert s.kv.owner_kv("p").pinned == 0 and s.kv.retention.expiries == 1
    s.program_op(EndProgram("p"))
    assert s.kv.num_free_blocks == 10


def test_end_program_releases_pins_and_reservation_and_tells_the_policy():
    ended = []
    s = make_scheduler(10, lambda: 0.0)
    s.policy.end_program = ended.append
    s.program_op(Reserve("p", 8))
    s.program_op(Pin("p", 9.0))
    a = make_req("a", range(9), "p", max_tokens=1)
    s.add_request(a)
    run_step(s)
    assert s.kv.owner_kv("p").pinned == 2 and s.kv.owner_kv("p").reserved == 2
    s.program_op(EndProgram("p"))
    assert ended == ["p"] and s.kv.num_free_blocks == 10 and s.kv.num_reserved_blocks == 0
    assert s.kv.owner_kv("p") == s.kv.owner_kv("never-seen")
    check(s.kv)
