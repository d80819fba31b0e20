"""Scheduling around pins (the policy switches `pinned_first`, `protect_pins` the scheduler reads):
exact state on tiny pools."""

from __future__ import annotations

from agentrt.engine.config import EngineConfig
from agentrt.engine.kv_cache_manager import KVCacheManager
from agentrt.engine.policy import FCFS
from agentrt.engine.program_ops import Pin
from agentrt.engine.request import Request, RequestStatus
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.scheduler import Scheduler
from tests.engine.test_kv_retention import BS, run_step


def make_req(rid: str, tokens, program: str, max_tokens: int = 1, arrival: float = 0.0) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), program_id=program, arrival_time=arrival)


def make_scheduler(num_blocks: int, policy: FCFS, **kw) -> Scheduler:
    cfg = EngineConfig(block_size=BS, num_blocks=num_blocks, device="cpu", **kw)
    return Scheduler(cfg, KVCacheManager(num_blocks, BS), policy, clock=lambda: 0.0)


def pin_a_call(s: Scheduler, program: str, tokens) -> Request:
    """Run one call of `program` to its end with a pin set: its full blocks stay pinned."""
    s.program_op(Pin(program, 100.0))
    r = make_req(f"{program}-0", tokens, program)
    s.add_request(r)
    while not r.finished:
        run_step(s)
    return r


def test_pinned_first_puts_a_resuming_program_ahead_of_earlier_calls():
    for pinned_first, first in ((False, "new"), (True, "p-1")):
        s = make_scheduler(16, FCFS(pinned_first=pinned_first), max_num_seqs=1)
        first_call = pin_a_call(s, "p", range(8))
        assert s.kv.holds_pin("p") and not s.kv.holds_pin("q")
        new = make_req("new", range(100, 108), "q", arrival=1.0)
        resumed = make_req("p-1", [*first_call.all_token_ids, 50, 51], "p", arrival=2.0)
        s.add_request(new)
        s.add_request(resumed)
        out = s.schedule()
        assert [r.request_id for r in out.reqs] == [first]


def test_protect_pins_keeps_a_paused_programs_kv_from_a_new_program():
    # 8 blocks: p's pin holds 2, r runs on 2; q's call needs 4 + 1 (output). Without protection q's first
    # chunk goes in at once and its second takes one of p's pinned blocks; with it, q waits for the whole
    # call to fit, which it does once r is done, and p keeps its pin
    for protect, q_admitted_early, pins_kept in ((False, True, 1), (True, False, 2)):
        s = make_scheduler(8, FCFS(protect_pins=protect), max_num_batched_tokens=8)
        pin_a_call(s, "p", range(8))
        r = make_req("r", range(200, 207), "r", max_tokens=3)
        s.add_request(r)
        run_step(s)
        assert s.kv.num_free_blocks == 4 and s.kv.owner_kv("p").pinned == 2
        q = make_req("q", range(100, 116), "q", arrival=1.0)
        s.add_request(q)
        out = run_step(s)
        assert (q in out.reqs) == q_admitted_early and s.kv.owner_kv("p").pinned == 2
        while s.has_work():
            run_step(s)
        assert q.status == RequestStatus.FINISHED_LENGTH and q.num_preemptions == 0  # never stuck
        assert s.kv.owner_kv("p").pinned == pins_kept


def test_protect_pins_lets_the_pinned_program_resume_and_take_others_pins():
    s = make_scheduler(8, FCFS(pinned_first=True, protect_pins=True), max_num_batched_tokens=16)
    a = pin_a_call(s, "p", range(8))  # 2 blocks pinned
    pin_a_call(s, "o", range(300, 316))  # 4 blocks pinned
    r = make_req("r", range(200, 203), "r", max_tokens=4)  # 1 block, keeps the engine busy
    s.add_request(r)
    run_step(s)
    assert s.kv.num_free_blocks == 1
    resumed = make_req("p-1", [*a.all_token_ids, *range(60, 67)], "p", max_tokens=1)  # 16 tokens + 1: 5 blocks
    s.add_request(resumed)
    out = run_step(s)
    assert resumed in out.reqs and resumed.num_prefix_hit_tokens == 8
    assert s.kv.owner_kv("o").pinned == 3 and s.kv.retention.pin_blocks_given_way == 1  # o's tail gave way
    assert s.kv.retention.ttl_hits == 1  # p resumed on its pinned prefix


def test_pin_settings_are_part_of_the_policy_seam():
    from agentrt.engine.policy import FCFS, SchedulingPolicy, make_policy

    assert SchedulingPolicy.pinned_first is False and SchedulingPolicy.protect_pins is False
    assert FCFS().pinned_first is False and FCFS().protect_pins is False
    pol = make_policy("fcfs", pinned_first=True, protect_pins=True)
    assert isinstance(pol, FCFS) and pol.pinned_first and pol.protect_pins


def test_admission_horizon_bounds_the_output_that_must_fit():
    # 8 blocks of 4: r runs on 2 (7 prompt + 3 output); q (8 prompt tokens) asks for 24 output tokens, all 8
    # blocks. Whole-fit admission waits for the whole call, which cannot fit while r runs; with a horizon of
    # 4 output tokens q needs 3 blocks and goes in at once. Neither is ever stuck, and every block comes back
    for horizon, admitted_early in ((None, False), (4, True)):
        pol = FCFS(protect_pins=True)
        pol.admit_output_tokens = horizon
        s = make_scheduler(8, pol, max_num_batched_tokens=16, max_model_len=32)
        r = make_req("r", range(200, 207), "r", max_tokens=3)
        s.add_request(r)
        run_step(s)
        q = make_req("q", range(100, 108), "q", max_tokens=24, arrival=1.0)
        s.add_request(q)
        assert s.kv.fits_whole(q, [], True, 4) and not s.kv.fits_whole(q, [], True, None)
        out = run_step(s)
        assert (q in out.reqs) == admitted_early
        while s.has_work():
            run_step(s)
        assert r.status == q.status == RequestStatus.FINISHED_LENGTH
        assert s.kv.num_free_blocks == 8


class _Ranked(FCFS):
    """FCFS whose `outranks` says a waiting call outranks exactly the programs in `below`."""

    pins_by_rank = True

    def __init__(self, below: set[str]) -> None:
        super().__init__(protect_pins=True)
        self.below = below

    def outranks(self, waiting: Request, program_id: str) -> bool:
        return program_id in self.below


def test_pins_by_rank_give_way_to_the_calls_that_outrank_their_program_only():
    # 8 blocks of 4: p and o each pin 2 blocks, q (resuming) 1; r runs on 1. q's next call extends its pinned block to
    # 16 tokens and 1 output token: 4 more blocks for the whole call, 3 of them now, with 2 free. Plain protect_pins: a
    # program holding a pin takes anyone's (the newest program's first: q's own, then o's). By rank: only the pins
    # of the programs it outranks, from the tail (o's, or p's; never the other's); ranking above neither, it waits
    # until r is done. A new program (no pin) takes no pin either way. Every block comes back.
    for below, admitted_early, o_pinned, p_pinned in ((None, True, 1, 2), (set(), False, 2, 2), ({"o"}, True, 1, 2),
                                                      ({"p"}, True, 2, 1)):
        pol = FCFS(protect_pins=True) if below is None else _Ranked(below)
        s = make_scheduler(8, pol, max_num_batched_tokens=16)
        pin_a_call(s, "p", range(8))
        pin_a_call(s, "o", range(300, 308))
        first = pin_a_call(s, "q", range(100, 104))
        r = make_req("r", range(200, 203), "r", max_tokens=4)
        s.add_request(r)
        run_step(s)
        assert s.kv.num_free_blocks == 2
        new = make_req("x-0", range(400, 412), "x", arrival=2.0)  # 3 blocks + 1: no pin of its own
        q = make_req("q-1", [*first.all_token_ids, *range(110, 121)], "q", arrival=1.0)
        s.add_request(new)
        s.add_request(q)
        out = run_step(s)
        assert new not in out.reqs
        assert (q in out.reqs) == admitted_early, below
        assert (s.kv.owner_kv("o").pinned, s.kv.owner_kv("p").pinned) == (o_pinned, p_pinned), below
        while s.has_work():
            run_step(s)
        assert q.status == new.status == RequestStatus.FINISHED_LENGTH and q.num_preemptions == 0
        for program in ("p", "o", "q", "x"):
            s.program_op(Pin(program, 0.0))
        assert s.kv.num_free_blocks == 8


def test_pins_by_rank_is_off_unless_a_policy_sets_it():
    from agentrt.engine.policy import SchedulingPolicy

    assert SchedulingPolicy.pins_by_rank is False and FCFS().pins_by_rank is False
    assert FCFS().outranks(make_req("a", range(4), "a"), "b") is False


def test_new_take_pins_lets_a_new_program_take_the_pins_it_outranks():
    # 8 blocks of 4: p and o each pin 2, r runs on 1, 3 are free; x, a new program (no pin), needs 4 for its 13 prompt
    # tokens. With pins_by_rank alone it takes nobody's pin and waits for r; with new_take_pins it
    # takes one block of the pins of the program it outranks (o), never p's; ranking above nobody it waits.
    for below, new_take, admitted_early, o_pinned in (({"o"}, False, False, 2), ({"o"}, True, True, 1),
                                                      (set(), True, False, 2)):
        pol = _Ranked(below)
        pol.new_take_pins = new_take
        s = make_scheduler(8, pol, max_num_batched_tokens=16)
        pin_a_call(s, "p", range(8))
        pin_a_call(s, "o", range(300, 308))
        r = make_req("r", range(200, 203), "r", max_tokens=4)
        s.add_request(r)
        run_step(s)
        assert s.kv.num_free_blocks == 3
        x = make_req("x-0", range(400, 413), "x", arrival=2.0)
        s.add_request(x)
        out = run_step(s)
        assert (x in out.reqs) == admitted_early, (below, new_take)
        assert (s.kv.owner_kv("o").pinned, s.kv.owner_kv("p").pinned) == (o_pinned, 2), (below, new_take)
        while s.has_work():
            run_step(s)
        assert x.status == RequestStatus.FINISHED_LENGTH and x.num_preemptions == 0
        for program in ("p", "o"):
            s.program_op(Pin(program, 0.0))
        assert s.kv.num_free_blocks == 8


class _Headroom(FCFS):
    """FCFS that keeps headroom: calls of programs named long* leave room for the others."""

    keeps_headroom = True

    def leaves_headroom(self, req: Request) -> bool:
        return req.program_id.startswith("long")


def _long_call(s: Scheduler, rid: str, blocks: int) -> Request:
    """A call of a long program whose prompt and one output token take `blocks` blocks."""
    return make_req(rid, range(1000 + 100 * len(rid), 1000 + 100 * len(rid) + blocks * BS - 1), "long-" + rid)


def test_headroom_keeps_the_blocks_a_better_call_needs_free_of_long_calls():
    s = make_scheduler(64, _Headroom(), max_num_batched_tokens=256)
    bg = make_req("bg", range(3), "bg", max_tokens=150)  # keeps the engine busy: never idle below
    s.add_request(bg)
    run_step(s)
    for i in range(8):  # better calls: 8 prompt tokens and 4 output, 3 blocks each, admitted while bg runs
        assert s.headroom_blocks() == 0  # not fitted before 8 were seen
        short = make_req(f"s{i}", range(100 + 20 * i, 108 + 20 * i), f"s{i}", max_tokens=4)
        s.add_request(short)
        while not short.finished:
            run_step(s)
    assert s.headroom_blocks() == 3
    free = s.kv.num_free_blocks
    eats = _long_call(s, "a", free - 2)  # would leave 2 free (1 if bg's next token starts a block): it waits
    s.add_request(eats)
    out = run_step(s)
    assert eats not in out.reqs and eats in s.waiting
    short = make_req("s8", range(500, 508), "s8", max_tokens=4)  # a better call behind it still goes in
    s.add_request(short)
    out = run_step(s)
    assert short in out.reqs and eats in s.waiting
    while not short.finished:
        run_step(s)
    s.finish(eats, RequestStatus.FINISHED_ABORTED)
    free = s.kv.num_free_blocks
    leaves = _long_call(s, "bb", free - 4)  # leaves the headroom (3 blocks) even after bg's next block: it goes in
    s.add_request(leaves)
    out = run_step(s)
    assert leaves in out.reqs
    while s.has_work() and not leaves.finished:
        run_step(s)
    s.finish(bg, RequestStatus.FINISHED_ABORTED)
    assert not s.running
    idle = _long_call(s, "ccc", s.kv.num_free_blocks - 1)  # an idle engine keeps no headroom
    s.add_request(idle)
    out = run_step(s)
    assert idle in out.reqs
    while s.has_work():
        run_step(s)
    assert s.kv.num_free_blocks == 64


def test_headroom_is_off_unless_a_policy_keeps_it():
    from agentrt.engine.policy import SchedulingPolicy

    assert SchedulingPolicy.keeps_headroom is False and SchedulingPolicy.new_take_pins is False
    assert FCFS().leaves_headroom(make_req("a", range(4), "a")) is False
    s = make_scheduler(32, FCFS())
    assert s.headroom_blocks() == 0


class _Yields(FCFS):
    """FCFS whose prompts yield 8 tokens a step to older calls while calls wait for blocks."""

    yields_prefill = True

    def prefill_yield(self) -> int:
        return 8


def _yield_scenario(policy: FCFS) -> tuple[Scheduler, Request, Request, Request]:
    """An old call decoding, a big call that waits for blocks behind it, and a prompt between them by arrival."""
    s = make_scheduler(16, policy, max_num_batched_tokens=64)
    old = make_req("old", range(11), "old", max_tokens=4)  # 3 blocks, decodes
    big = make_req("big", range(100, 156), "big", arrival=0.1)  # 14 blocks: waits while old runs
    s.add_request(old)
    s.add_request(big)
    out = run_step(s)
    assert out.reqs == [old] and big in s.waiting  # a call waits for blocks now
    mid = make_req("mid", range(200, 240), "mid", arrival=0.05)  # 40 prompt tokens, ranked after old, before big
    s.add_request(mid)
    return s, old, big, mid


def test_prompts_yield_to_better_decoding_calls_while_calls_wait_for_blocks():
    s, old, big, mid = _yield_scenario(_Yields())
    chunks = []
    while not old.finished:
        out = run_step(s)
        chunks.append(dict(zip((r.request_id for r in out.reqs), out.num_tokens)).get("mid"))
    assert chunks == [8, 8, 8]  # while old decodes: 8 a step (admission and running alike)
    assert big in s.waiting
    out = run_step(s)  # old is done: nothing better decodes, and big ranks below mid: the rest in one chunk
    assert dict(zip((r.request_id for r in out.reqs), out.num_tokens))["mid"] == 16
    while s.has_work():
        run_step(s)
    assert mid.finished and big.finished and s.kv.num_free_blocks == 16


def test_prompts_take_the_whole_budget_without_the_yield():
    s, old, big, mid = _yield_scenario(FCFS())
    out = run_step(s)
    assert dict(zip((r.request_id for r in out.reqs), out.num_tokens)) == {"old": 1, "mid": 40}
    while s.has_work():
        run_step(s)
    assert s.kv.num_free_blocks == 16


class _Backfill(FCFS):
    """FCFS that lets calls that fit go in behind a head that does not, for its first second of waiting."""

    backfill_s = 1.0


def test_backfill_lets_a_call_that_fits_pass_a_head_that_does_not_for_backfill_s():
    for policy, passes in ((FCFS(), False), (_Backfill(), True)):
        now = [0.0]
        cfg = EngineConfig(block_size=BS, num_blocks=16, device="cpu", max_num_batched_tokens=64)
        s = Scheduler(cfg, KVCacheManager(16, BS), policy, clock=lambda: now[0])
        old = make_req("old", range(11), "old", max_tokens=8)  # 3 blocks, then 5 as it decodes
        s.add_request(old)
        run_step(s)
        big = make_req("big", range(100, 160), "big")  # 15 blocks: waits while old runs
        small = make_req("small", range(200, 207), "small", max_tokens=2, arrival=0.1)  # 2 blocks, behind big
        s.add_request(big)
        s.add_request(small)
        now[0] = 0.5  # big has waited 0.5 s
        out = run_step(s)
        assert big in s.waiting and (small in out.reqs) is passes
        while not small.finished and passes:
            run_step(s)
        now[0] = 1.5  # big has waited past backfill_s: the line waits for it
        late = make_req("late", range(300, 307), "late", max_tokens=2, arrival=1.4)
        s.add_request(late)
        out = run_step(s)
        assert late not in out.reqs and big in s.waiting
        while s.has_work():
            run_step(s)
        assert big.finished and late.finished and s.kv.num_free_blocks == 16
