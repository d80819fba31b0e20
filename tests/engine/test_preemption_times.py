"""The engine reports when each preemption happened and when its request was scheduled again
(RequestMetrics.preemptions), what program timelines mark."""

from agentrt.engine import LLM, SamplingParams
from tests.engine.test_engine import prompts_of


def test_preemptions_are_timed(tiny_model_path):
    small = LLM(str(tiny_model_path), num_blocks=14, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    outs = small.generate(prompts_of([9, 13, 11, 10], seed=1), SamplingParams(max_tokens=10, temperature=0,
                                                                               ignore_eos=True))
    assert small.kv_stats().num_preemptions > 0
    seen = 0
    for o in outs:
        m = o.metrics
        assert len(m.preemptions) == m.num_preemptions
        for at, back in m.preemptions:
            assert back is not None  # every one ran again, since every request finished
            assert m.first_scheduled_time <= at <= back <= m.finish_time
        seen += m.num_preemptions
        assert m.num_tier_loaded_tokens == 0  # no tiers
    assert seen == small.kv_stats().num_preemptions
    assert not small.core._preempted  # nothing left behind


def test_a_preempted_request_aborted_while_waiting_is_forgotten_at_once(tiny_model_path):
    """Issue 52: aborting a request that waits after a preemption drops it from the engine's preemption
    bookkeeping in the abort itself, not at some later step (an idle engine takes none)."""
    from agentrt.engine.request import RequestStatus

    small = LLM(str(tiny_model_path), num_blocks=14, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    core = small.core
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    reqs = [core.add_request(p, params) for p in prompts_of([9, 13, 11, 10], seed=1)]
    victim = None
    for _ in range(200):  # the same shapes preempt within a few steps (test_preemptions_are_timed)
        core.step()
        waiting = [r for r in core._preempted.values() if r.status == RequestStatus.WAITING]
        if waiting:
            victim = waiting[0]
            break
    assert victim is not None, "no request was preempted: the test's shapes no longer force a preemption"
    assert victim.preemptions and victim.preemptions[-1][1] is None  # preempted, not scheduled again yet
    core.abort(victim.request_id)
    assert victim.finish_reason == "abort" and victim.request_id not in core._preempted
    assert victim.preemptions[-1][1] is None  # the timeline keeps its preemption, with no return
    core.release(victim.request_id)
    while core.has_work():
        core.step()
    for r in reqs:
        core.release(r.request_id)
    assert core.num_tracked() == dict.fromkeys(core.num_tracked(), 0)  # "preempted" among them
