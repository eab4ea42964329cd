"""/metrics with data parallelism: the scheduler's series once per replica, labelled
with vLLM's `engine` (the replica index); one engine keeps the single engine="0"."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from flowengine.engine.protocol import EngineStats
from flowengine.metrics import ServingMetrics


def _samples(stats: EngineStats) -> dict[tuple[str, str], float]:
    text = ServingMetrics(lambda: stats, "m").render().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "engine" in s.labels and not s.name.endswith(("_bucket", "_created")):
                out[(s.name, s.labels["engine"])] = s.value
    return out


def test_per_replica_series_carry_the_engine_index() -> None:
    engines = [
        EngineStats(num_running=3, num_waiting=1, kv_cache_usage=0.25, generation_tokens_total=40,
                    num_preemptions_total=2, prefix_cache_queries_total=64,
                    prefix_cache_hits_total=16, cache_config={"num_gpu_blocks": "100"}),
        EngineStats(num_running=5, num_waiting=0, kv_cache_usage=0.5, generation_tokens_total=60,
                    num_preemptions_total=0, prefix_cache_queries_total=32,
                    prefix_cache_hits_total=0, cache_config={"num_gpu_blocks": "120"}),
    ]
    total = EngineStats(num_running=8, num_waiting=1, prompt_tokens_total=77,
                        generation_tokens_total=100, finished_by_reason={"length": 4},
                        cache_config={"num_gpu_blocks": "220"}, per_engine=engines)
    got = _samples(total)
    p = "flowengine:"
    assert got[(p + "num_requests_running", "0")] == 3
    assert got[(p + "num_requests_running", "1")] == 5
    assert got[(p + "num_requests_waiting", "0")] == 1
    assert got[(p + "num_requests_waiting", "1")] == 0
    assert got[(p + "kv_cache_usage_perc", "0")] == 0.25
    assert got[(p + "kv_cache_usage_perc", "1")] == 0.5
    assert got[(p + "generation_tokens_total", "0")] == 40
    assert got[(p + "generation_tokens_total", "1")] == 60
    assert got[(p + "num_preemptions_total", "0")] == 2
    assert got[(p + "prefix_cache_queries_total", "1")] == 32
    assert got[(p + "prefix_cache_hits_total", "0")] == 16
    # Observed by the frontend per request: one series, engine "0".
    assert got[(p + "prompt_tokens_total", "0")] == 77
    assert (p + "prompt_tokens_total", "1") not in got
    assert got[(p + "request_success_total", "0")] == 4
    text = ServingMetrics(lambda: total, "m").render().decode()
    assert 'cache_config_info{engine="0",num_gpu_blocks="100"} 1.0' in text
    assert 'cache_config_info{engine="1",num_gpu_blocks="120"} 1.0' in text


def test_one_engine_has_engine_zero_only() -> None:
    got = _samples(EngineStats(num_running=2, generation_tokens_total=9))
    assert got[("flowengine:num_requests_running", "0")] == 2
    assert got[("flowengine:generation_tokens_total", "0")] == 9
    assert not [k for k in got if k[1] != "0"]
