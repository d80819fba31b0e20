import threading
import time

import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from agentrt.server.metrics import EngineState, Metrics

NAMES = {
    "agentrt:num_requests_running": "gauge",
    "agentrt:num_requests_waiting": "gauge",
    "agentrt:kv_cache_usage_perc": "gauge",
    "agentrt:programs_active": "gauge",
    "agentrt:running_seats": "gauge",
    "agentrt:calls_per_queue_level": "gauge",
    "agentrt:prefix_cache_queries": "counter",
    "agentrt:prefix_cache_hits": "counter",
    "agentrt:num_preemptions": "counter",
    "agentrt:prompt_tokens": "counter",
    "agentrt:generation_tokens": "counter",
    "agentrt:request_success": "counter",
    "agentrt:requests_failed": "counter",
    "agentrt:time_to_first_token_seconds": "histogram",
    "agentrt:inter_token_latency_seconds": "histogram",
    "agentrt:e2e_request_latency_seconds": "histogram",
    "agentrt:program_latency_seconds": "histogram",
}


def state(**kw) -> EngineState:
    fields = dict(running=0, waiting=0, kv_usage=0.0, prefix_queries_tokens=0, prefix_hit_tokens=0,
                  num_preemptions=0, programs_active=0, calls_per_level={})
    return EngineState(**(fields | kw))


def sample(m: Metrics, name: str, **labels) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_exposition_has_every_metric():
    m = Metrics()
    body, content_type = m.render()
    assert content_type == CONTENT_TYPE_LATEST
    families = {f.name: f.type for f in text_string_to_metric_families(body.decode())}
    assert {n: families.get(n) for n in NAMES} == NAMES
    assert b"agentrt:prompt_tokens_total 0.0" in body


def test_observe_call_counts_tokens_and_fills_histograms():
    m = Metrics()
    m.observe_call(ttft_s=0.03, inter_token_s=[0.01, 0.02, 0.2], e2e_s=0.5, prompt_tokens=11, generation_tokens=4,
                   finish_reason="stop")
    m.observe_call(ttft_s=None, inter_token_s=[], e2e_s=2.0, prompt_tokens=5, generation_tokens=0,
                   finish_reason="abort")
    m.observe_call(ttft_s=1.5, inter_token_s=(), e2e_s=1.5, prompt_tokens=1, generation_tokens=1,
                   finish_reason="stop")
    m.observe_failure()
    m.observe_program_end(42.0)

    assert sample(m, "agentrt:prompt_tokens_total") == 17
    assert sample(m, "agentrt:generation_tokens_total") == 5
    assert sample(m, "agentrt:request_success_total", finished_reason="stop") == 2
    assert sample(m, "agentrt:request_success_total", finished_reason="abort") == 1
    assert sample(m, "agentrt:requests_failed_total") == 1
    assert sample(m, "agentrt:time_to_first_token_seconds_count") == 2
    assert sample(m, "agentrt:time_to_first_token_seconds_sum") == pytest.approx(1.53)
    assert sample(m, "agentrt:time_to_first_token_seconds_bucket", le="0.04") == 1
    assert sample(m, "agentrt:inter_token_latency_seconds_count") == 3
    assert sample(m, "agentrt:inter_token_latency_seconds_bucket", le="0.02") == 2
    assert sample(m, "agentrt:e2e_request_latency_seconds_count") == 3
    assert sample(m, "agentrt:e2e_request_latency_seconds_sum") == 4.0
    assert sample(m, "agentrt:program_latency_seconds_count") == 1
    assert sample(m, "agentrt:program_latency_seconds_bucket", le="30.0") == 0
    assert sample(m, "agentrt:program_latency_seconds_bucket", le="60.0") == 1


def test_engine_totals_advance_counters_by_deltas():
    m = Metrics()
    m.set_engine_state(running=3, waiting=7, kv_usage=0.25, prefix_queries_tokens=100, prefix_hit_tokens=40,
                       num_preemptions=2, programs_active=4, calls_per_level={0: 5, 1: 2})
    m.set_engine_state(running=1, waiting=0, kv_usage=0.5, prefix_queries_tokens=160, prefix_hit_tokens=40,
                       num_preemptions=3, programs_active=2, calls_per_level={1: 1})
    assert sample(m, "agentrt:prefix_cache_queries_total") == 160
    assert sample(m, "agentrt:prefix_cache_hits_total") == 40
    assert sample(m, "agentrt:num_preemptions_total") == 3
    assert sample(m, "agentrt:num_requests_running") == 1
    assert sample(m, "agentrt:num_requests_waiting") == 0
    assert sample(m, "agentrt:kv_cache_usage_perc") == 0.5
    assert sample(m, "agentrt:programs_active") == 2
    assert sample(m, "agentrt:calls_per_queue_level", level="0") == 0  # emptied, not stale
    assert sample(m, "agentrt:calls_per_queue_level", level="1") == 1

    # a late report of lower totals moves nothing back and adds nothing
    m.set_engine_state(running=0, waiting=0, kv_usage=0.0, prefix_queries_tokens=120, prefix_hit_tokens=40,
                       num_preemptions=2, programs_active=0, calls_per_level={})
    m.set_engine_state(running=0, waiting=0, kv_usage=0.0, prefix_queries_tokens=170, prefix_hit_tokens=45,
                       num_preemptions=3, programs_active=0, calls_per_level={})
    assert sample(m, "agentrt:prefix_cache_queries_total") == 170
    assert sample(m, "agentrt:prefix_cache_hits_total") == 45
    assert sample(m, "agentrt:num_preemptions_total") == 3


def test_state_fn_refreshes_at_scrape_time():
    totals = iter([10, 25])
    m = Metrics(state_fn=lambda: state(running=2, prefix_queries_tokens=next(totals), calls_per_level={2: 3},
                                       running_seats=16))
    m.render()
    body, _ = m.render()
    assert b"agentrt:num_requests_running 2.0" in body
    assert b"agentrt:running_seats 16.0" in body  # the running-set limit the policy set for the latest step
    assert b"agentrt:prefix_cache_queries_total 25.0" in body
    assert b'agentrt:calls_per_queue_level{level="2"} 3.0' in body


def test_failing_state_fn_keeps_the_last_state():
    states = iter([state(waiting=4)])
    m = Metrics(state_fn=lambda: next(states))  # the second call raises StopIteration
    m.render()
    body, _ = m.render()
    assert b"agentrt:num_requests_waiting 4.0" in body


def test_two_instances_do_not_clash():
    a, b = Metrics(), Metrics()
    a.observe_failure()
    assert sample(a, "agentrt:requests_failed_total") == 1
    assert sample(b, "agentrt:requests_failed_total") == 0


def test_racing_reports_count_each_token_once():
    m = Metrics()
    lock = threading.Lock()
    total = 0

    def report():
        nonlocal total
        for _ in range(500):
            with lock:  # the engine's total only grows, but reports of it race and arrive out of order
                total += 3
                t = total
            m.set_engine_state(0, 0, 0.0, t, 0, 0, 0, {})

    threads = [threading.Thread(target=report) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sample(m, "agentrt:prefix_cache_queries_total") == total == 6000


def lora_series(m: Metrics) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for f in m.registry.collect() if f.name == "agentrt:lora_requests_info"
            for s in f.samples]


def test_lora_info_is_one_series_whose_labels_follow_the_adapters():
    m = Metrics()
    m.set_engine_state(0, 0, 0.0, 0, 0, 0, 0, {})
    assert lora_series(m) == []  # LoRA off: no gauge at all
    assert b"lora_requests_info" not in m.render()[0]

    states = iter([state(max_lora=4, running_lora_adapters="qv,sql", waiting_lora_adapters="sql"),
                   state(max_lora=4, running_lora_adapters="sql"), state(max_lora=4), state(max_lora=4)])
    m = Metrics(state_fn=lambda: next(states))
    before = time.time()
    m.render()
    ((labels, value),) = lora_series(m)
    assert labels == {"max_lora": "4", "running_lora_adapters": "qv,sql", "waiting_lora_adapters": "sql"}
    assert before - 1 <= value <= time.time() + 1  # vLLM's value: when the adapters were read
    m.render()
    assert [s[0] for s in lora_series(m)] == [
        {"max_lora": "4", "running_lora_adapters": "sql", "waiting_lora_adapters": ""}]  # the old set removed
    for _ in range(2):  # the same labels again: still one series, its time moved on
        m.render()
        ((labels, _),) = lora_series(m)
        assert labels == {"max_lora": "4", "running_lora_adapters": "", "waiting_lora_adapters": ""}


def test_kv_tier_series_per_tier_follow_the_engine_totals():
    from agentrt.engine.kv_host import TierStats

    m = Metrics()
    m.render(state(kv_tiers={"host": TierStats(blocks=5, bytes=500, hits=3, demotions=7, load_s=0.25),
                             "disk": TierStats(blocks=9, bytes=900, hits=1, corrupt=1, prefetched=2)}))
    m.render(state(kv_tiers={"host": TierStats(blocks=4, bytes=400, hits=6, demotions=7, evictions=2, load_s=0.5),
                             "disk": TierStats(blocks=9, bytes=900, hits=1, corrupt=1, prefetched=2)}))
    assert sample(m, "agentrt:kv_tier_blocks", tier="host") == 4
    assert sample(m, "agentrt:kv_tier_bytes", tier="disk") == 900
    assert sample(m, "agentrt:kv_tier_hits_total", tier="host") == 6
    assert sample(m, "agentrt:kv_tier_hits_total", tier="disk") == 1
    assert sample(m, "agentrt:kv_tier_demotions_total", tier="host") == 7
    assert sample(m, "agentrt:kv_tier_evictions_total", tier="host") == 2
    assert sample(m, "agentrt:kv_tier_corrupt_files_total", tier="disk") == 1
    assert sample(m, "agentrt:kv_tier_prefetched_total", tier="disk") == 2
    assert sample(m, "agentrt:kv_tier_load_seconds_total", tier="host") == 0.5
    assert sample(m, "agentrt:kv_tier_hits_total", tier="none") is None
