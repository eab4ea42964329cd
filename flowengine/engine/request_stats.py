"""Per-request statistics with vLLM v1's meanings (`vllm/v1/metrics/stats.py`,
`loggers.py`): token counts, queue/prefill/decode/inference times, TPOT, n, max_tokens.

Pure logic (no prometheus, no asyncio): the Detokenizer actor feeds it every request it
registers and every engine output; `/metrics` reads cumulative histograms from it
(`flowengine.metrics` renders them). Definitions, per engine request (one sample of n):

- queue time: first scheduled - arrival; prefill time: first token - first scheduled;
  decode time: last token - first token; inference time: last token - first scheduled;
  time per output token: decode time / (generation tokens - 1), 0 with one token.
- prompt tokens computed: prompt length - prefix-cache hit tokens, counted once, when
  the request's first token arrives (vLLM's `prompt_tokens_total`).
- iteration tokens: per engine step, prompt tokens computed by requests whose first
  token came in that step plus every generated token of the step.
- time to first token: first token - arrival; inter-token latency: one observation per
  engine step that brings a request tokens after its first, the time since its
  previous ones; end-to-end latency: finish - arrival, for every finished request.
  They are taken here, where each engine output arrives, whatever output kind the
  caller asked for (a FINAL_ONLY caller sees one output), as vLLM's output processor
  does (`vllm/v1/engine/output_processor.py`, IterationStats).

Times are `time.monotonic()` seconds; "first scheduled" comes from the engine process
(`RequestDelta.scheduled_ts`), which shares the host's monotonic clock.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass, field

# Bucket edges, vLLM v1's (loggers.py).
REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TPOT_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS_S = REQUEST_LATENCY_BUCKETS_S
# vLLM's build_cudagraph_buckets with enforce_eager (a fixed list).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's `build_1_2_5_buckets`)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


@dataclass
class HistogramData:
    """A cumulative histogram: counts[i] = observations <= buckets[i]; the last entry of
    `counts` counts everything (+Inf). `sum` in the observed unit."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        # Stored per bucket; made cumulative in snapshot() (one increment per observe).
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def snapshot(self) -> HistogramData:
        """A copy with cumulative counts (Prometheus' `le` buckets, +Inf last)."""
        cumulative, total = [], 0
        for c in self.counts:
            total += c
            cumulative.append(total)
        return HistogramData(self.buckets, cumulative, self.sum)


@dataclass(slots=True)
class _Timing:
    arrival_s: float
    num_prompt_tokens: int
    max_tokens: int
    scheduled_s: float = 0.0
    first_token_s: float = 0.0
    last_token_s: float = 0.0
    num_generation_tokens: int = 0


class RequestStats:
    """Cumulative per-request statistics of one frontend.

    Args:
        max_model_len: context limit, for the token-count buckets (1-2-5 up to it) and
            the max_tokens of a request without one (context left after the prompt).
    """

    HISTOGRAMS = (
        "request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total",
        "request_queue_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds", "request_inference_time_seconds",
        "request_time_per_output_token_seconds", "request_params_n",
        "request_params_max_tokens", "time_to_first_token_seconds",
        "inter_token_latency_seconds", "e2e_request_latency_seconds",
    )  # fmt: skip

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        tokens = build_1_2_5_buckets(max_model_len)
        self.histograms: dict[str, HistogramData] = {
            "request_prompt_tokens": HistogramData(tokens),
            "request_generation_tokens": HistogramData(tokens),
            "iteration_tokens_total": HistogramData(ITERATION_TOKENS_BUCKETS),
            "request_queue_time_seconds": HistogramData(REQUEST_LATENCY_BUCKETS_S),
            "request_prefill_time_seconds": HistogramData(REQUEST_LATENCY_BUCKETS_S),
            "request_decode_time_seconds": HistogramData(REQUEST_LATENCY_BUCKETS_S),
            "request_inference_time_seconds": HistogramData(REQUEST_LATENCY_BUCKETS_S),
            "request_time_per_output_token_seconds": HistogramData(TPOT_BUCKETS_S),
            "request_params_n": HistogramData(PARAMS_N_BUCKETS),
            "request_params_max_tokens": HistogramData(tokens),
            "time_to_first_token_seconds": HistogramData(TTFT_BUCKETS_S),
            "inter_token_latency_seconds": HistogramData(ITL_BUCKETS_S),
            "e2e_request_latency_seconds": HistogramData(E2E_BUCKETS_S),
        }
        self._ttft = self.histograms["time_to_first_token_seconds"]
        self._itl = self.histograms["inter_token_latency_seconds"]
        self.prompt_tokens_computed_total = 0
        self.prompt_tokens_cached_total = 0
        self._live: dict[str, _Timing] = {}

    def add_request(self, child_ids: list[str], num_prompt_tokens: int, n: int,
                    max_tokens: int | None, arrival_s: float) -> None:
        """A user request of `n` samples (engine ids `child_ids`) was admitted."""
        self.histograms["request_params_n"].observe(n)
        if max_tokens is None:
            max_tokens = self.max_model_len - num_prompt_tokens
        for cid in child_ids:
            self._live[cid] = _Timing(arrival_s, num_prompt_tokens, max_tokens)

    def forget(self, child_ids: list[str]) -> None:
        """The caller dropped these requests (no finish delta will be observed)."""
        for cid in child_ids:
            self._live.pop(cid, None)

    def on_step(self, deltas: list, now_s: float | None = None) -> None:
        """Apply one engine step's `RequestDelta`s (received at `now_s`, monotonic)."""
        now = time.monotonic() if now_s is None else now_s
        iteration_tokens = 0
        live = self._live
        ttft, itl = self._ttft, self._itl
        for d in deltas:
            t = live.get(d.req_id)
            if t is None:
                continue
            if d.scheduled_ts and not t.scheduled_s:
                t.scheduled_s = d.scheduled_ts
            num_new = len(d.new_token_ids)
            if num_new:
                if not t.num_generation_tokens:  # prefill done: its first token
                    computed = t.num_prompt_tokens - d.num_cached_tokens
                    self.prompt_tokens_computed_total += computed
                    self.prompt_tokens_cached_total += d.num_cached_tokens
                    iteration_tokens += computed
                    t.first_token_s = now
                    ttft.observe(max(now - t.arrival_s, 0.0))
                else:
                    itl.observe(now - t.last_token_s)
                t.num_generation_tokens += num_new
                t.last_token_s = now
                iteration_tokens += num_new
            if d.finish_reason is not None:
                self._finish(live.pop(d.req_id), now)
        if iteration_tokens:
            self.histograms["iteration_tokens_total"].observe(iteration_tokens)

    def _finish(self, t: _Timing, now: float) -> None:
        h = self.histograms
        h["e2e_request_latency_seconds"].observe(max(now - t.arrival_s, 0.0))
        h["request_prompt_tokens"].observe(t.num_prompt_tokens)
        h["request_generation_tokens"].observe(t.num_generation_tokens)
        h["request_params_max_tokens"].observe(t.max_tokens)
        if not t.num_generation_tokens:
            return  # failed before its first token: no timings (vLLM records none)
        scheduled = t.scheduled_s or t.arrival_s
        decode = t.last_token_s - t.first_token_s
        h["request_queue_time_seconds"].observe(max(scheduled - t.arrival_s, 0.0))
        h["request_prefill_time_seconds"].observe(max(t.first_token_s - scheduled, 0.0))
        h["request_decode_time_seconds"].observe(decode)
        h["request_inference_time_seconds"].observe(max(t.last_token_s - scheduled, 0.0))
        tpot = decode / (t.num_generation_tokens - 1) if t.num_generation_tokens > 1 else 0.0
        h["request_time_per_output_token_seconds"].observe(tpot)

    def snapshot(self) -> dict[str, HistogramData]:
        """Cumulative copies of every histogram (for one /metrics scrape)."""
        return {name: h.snapshot() for name, h in self.histograms.items()}
