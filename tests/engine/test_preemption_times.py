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
