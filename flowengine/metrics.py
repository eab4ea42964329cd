"""Prometheus metrics of the server: vLLM's metric set under the `flowengine:` prefix.

Names, meanings and histogram buckets follow vLLM v1 (`vllm/v1/metrics/loggers.py`,
`PrometheusStatLogger`), with `vllm:` replaced by `flowengine:` so dashboards carry
over by renaming. Two sources feed them:

- gauges and counters are read from `EngineClient.get_stats()` when Prometheus
  scrapes (a custom collector), so they are exact engine totals, never sampled;
- histograms, the latency ones (TTFT, inter-token latency, end-to-end latency)
  included, are cumulative snapshots in `EngineStats.histograms`, filled by the
  frontend's `RequestStats` (flowengine/engine/request_stats.py) as each engine output
  arrives, whatever output kind the route asked for (a non-streaming route asks for
  one FINAL_ONLY output and still gets its TTFT and inter-token gaps counted).

Each `ServingMetrics` owns its own `CollectorRegistry` (several servers, e.g. in tests,
can live in one process). All metrics carry vLLM's labels `model_name` and `engine`
(the engine index: "0" with one engine; with data parallelism the scheduler's gauges
and counters, generation tokens and `cache_config_info` come once per replica, while
what the frontend observes per request, prompt tokens, `request_success` and the
histograms, stays one series under engine "0"; `cache_config_info` carries `engine` and
its config keys).

`prompt_tokens_total` counts prefill tokens computed, as vLLM does: prefix-cache hits
are not counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from flowengine.engine.protocol import EngineStats

# Bucket edges in seconds, vLLM v1's; RequestStats fills these histograms.
from flowengine.engine.request_stats import E2E_BUCKETS_S, ITL_BUCKETS_S, TTFT_BUCKETS_S

__all__ = ["E2E_BUCKETS_S", "ITL_BUCKETS_S", "TTFT_BUCKETS_S", "ServingMetrics"]

logger = logging.getLogger(__name__)

PREFIX = "flowengine:"
ENGINE_INDEX = "0"

# Help texts of the per-request histograms (vLLM's wording).
HISTOGRAM_DOCS = {
    "request_prompt_tokens": "Number of prefill tokens processed.",
    "request_generation_tokens": "Number of generation tokens processed.",
    "iteration_tokens_total": "Histogram of number of tokens per engine_step.",
    "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds "
    "per request.",
    "request_params_n": "Histogram of the n request parameter.",
    "request_params_max_tokens": "Histogram of the max_tokens request parameter.",
    "time_to_first_token_seconds": "Time to first token, seconds.",
    "inter_token_latency_seconds": "Time between output deltas, seconds.",
    "e2e_request_latency_seconds": "End-to-end request latency, seconds.",
}

def _spec_decode_metrics(stats: EngineStats, labels: list[str], values: list[str]
                         ) -> Iterator[Metric]:
    """vLLM's spec_decode counters (`vllm/v1/spec_decode/metrics.py`; 0 without
    speculative decoding); per_pos carries vLLM's `position` label (0 = first draft
    token), one sample per position when speculation is on."""
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    for name, doc, value in (
        ("spec_decode_num_drafts", "Number of spec decoding drafts.",
         stats.spec_decode_num_drafts_total),
        ("spec_decode_num_draft_tokens", "Number of draft tokens.",
         stats.spec_decode_num_draft_tokens_total),
        ("spec_decode_num_accepted_tokens", "Number of accepted tokens.",
         stats.spec_decode_num_accepted_tokens_total),
    ):
        c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
        c.add_metric(values, value)
        yield c
    c = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                            "Accepted tokens per draft position.",
                            labels=[*labels, "position"])
    for pos, count in enumerate(per_pos):
        c.add_metric([*values, str(pos)], count)
    yield c


class EngineStatsCollector(Collector):
    """Turns one `EngineStats` snapshot per scrape into gauges and counters."""

    def __init__(self, get_stats: Callable[[], EngineStats], model_name: str) -> None:
        self.get_stats = get_stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.get_stats()
        except Exception as err:
            # A dead engine must not break /metrics: the histograms are still served.
            logger.warning("engine stats unavailable: %s", err)
            return
        labels = ["model_name", "engine"]
        # Data parallel: the scheduler's series once per replica (engine = its index).
        engines = list(enumerate(stats.per_engine)) if stats.per_engine else [(ENGINE_INDEX, stats)]

        def gauge(name: str, doc: str, attr: str) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            for i, e in engines:
                g.add_metric([self.model_name, str(i)], getattr(e, attr))
            return g

        def counter(name: str, doc: str, attr: str, per_engine: bool = True
                    ) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for i, e in engines if per_engine else [(0, stats)]:
                c.add_metric([self.model_name, str(i)], getattr(e, attr))
            return c

        yield gauge("num_requests_running", "Requests in model execution batches.", "num_running")
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting")
        yield gauge("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", "kv_cache_usage")
        # Counted by the frontend, per server (engine "0"), as the histograms below.
        yield counter("prompt_tokens", "Prefill tokens processed.", "prompt_tokens_total",
                      per_engine=False)
        yield counter("generation_tokens", "Generation tokens processed.",
                      "generation_tokens_total")
        yield counter("num_preemptions", "Cumulative preemptions.", "num_preemptions_total")
        yield counter("prefix_cache_queries", "Prefix cache queries, in tokens.",
                      "prefix_cache_queries_total")
        yield counter("prefix_cache_hits", "Prefix cache hits, in tokens.",
                      "prefix_cache_hits_total")
        # Speculative decoding: totals over the replicas (engine "0").
        yield from _spec_decode_metrics(stats, labels, [self.model_name, ENGINE_INDEX])
        success = CounterMetricFamily(
            PREFIX + "request_success",
            "Successfully processed requests, by finish reason.",
            labels=["model_name", "engine", "finished_reason"],
        )
        for reason, count in sorted(stats.finished_by_reason.items()):
            success.add_metric([self.model_name, ENGINE_INDEX, reason], count)
        yield success
        engine_labels = ["model_name", "engine"]
        engine_values = [self.model_name, ENGINE_INDEX]
        # Every family is described even before the engine has data for it (an engine
        # without per-request stats, or before the first request): no sample then.
        for name, doc in HISTOGRAM_DOCS.items():
            family = HistogramMetricFamily(PREFIX + name, doc, labels=engine_labels)
            data = stats.histograms.get(name)
            if data is not None:
                edges = [*(_le(b) for b in data.buckets), "+Inf"]
                family.add_metric(
                    engine_values, list(zip(edges, data.counts, strict=True)), data.sum
                )
            yield family
        keys = sorted(stats.cache_config)
        info = GaugeMetricFamily(
            PREFIX + "cache_config_info", "Information of the LLMEngine CacheConfig",
            labels=[*keys, "engine"],
        )
        if keys:
            for i, e in engines:
                config = e.cache_config or stats.cache_config
                info.add_metric([config.get(k, "") for k in keys] + [str(i)], 1.0)
        yield info


def _le(bound: float) -> str:
    """A bucket bound as Prometheus writes it (1 -> "1.0")."""
    return repr(float(bound))


class ServingMetrics:
    """The metrics of one server: the engine's snapshot, collected per scrape.

    Args:
        get_stats: returns the engine's current `EngineStats` (called per scrape).
        model_name: value of the `model_name` label.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, get_stats: Callable[[], EngineStats], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(get_stats, model_name))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (format 0.0.4)."""
        return generate_latest(self.registry)
