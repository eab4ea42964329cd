"""RequestStats: vLLM v1's per-request metrics from known deltas and times (exact)."""

from __future__ import annotations

import pytest

from flowengine.engine.request_stats import RequestStats, build_1_2_5_buckets
from flowengine.messages import RequestDelta


def test_1_2_5_buckets() -> None:
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(4) == (1, 2)


def test_timings_tokens_and_iteration_histogram() -> None:
    rs = RequestStats(max_model_len=100)
    rs.add_request(["a"], num_prompt_tokens=40, n=1, max_tokens=None, arrival_s=10.0)
    rs.add_request(["b-0", "b-1"], num_prompt_tokens=8, n=2, max_tokens=3, arrival_s=10.5)
    # step 1: a's prefill (32 of 40 tokens from the prefix cache) and its first token
    rs.on_step([RequestDelta("a", [1], num_cached_tokens=32, scheduled_ts=11.0)], now_s=12.0)
    # step 2: a decodes, b's two samples prefill (no cache hit)
    rs.on_step([RequestDelta("a", [2]),
                RequestDelta("b-0", [5], scheduled_ts=12.0),
                RequestDelta("b-1", [6], scheduled_ts=12.0)], now_s=12.5)
    # step 3: a finishes with 3 tokens; b-0 finishes at 1 token; b-1 goes on
    rs.on_step([RequestDelta("a", [3], finish_reason="length"),
                RequestDelta("b-0", [], finish_reason="stop"),
                RequestDelta("b-1", [7])], now_s=13.5)
    rs.on_step([RequestDelta("b-1", [8], finish_reason="length")], now_s=14.5)
    assert rs.prompt_tokens_computed_total == (40 - 32) + 8 + 8
    assert rs.prompt_tokens_cached_total == 32
    h = rs.snapshot()
    it = h["iteration_tokens_total"]
    # per step: 8 + 1, 1 + 8 + 1 + 8 + 1, 1 + 1, 1
    assert it.sum == 9 + 19 + 2 + 1 and it.counts[-1] == 4
    assert it.counts[:4] == [1, 2, 3, 4]  # le=1: {1}, le=8: +2, le=16: +9, le=32: +19
    assert h["request_prompt_tokens"].sum == 40 + 8 + 8
    assert h["request_generation_tokens"].sum == 3 + 1 + 3
    assert h["request_params_n"].sum == 1 + 2 and h["request_params_n"].counts[-1] == 2
    assert h["request_params_max_tokens"].sum == (100 - 40) + 3 + 3
    assert h["request_queue_time_seconds"].sum == pytest.approx(1.0 + 1.5 + 1.5)
    assert h["request_prefill_time_seconds"].sum == pytest.approx(1.0 + 0.5 + 0.5)
    assert h["request_decode_time_seconds"].sum == pytest.approx(1.5 + 0.0 + 2.0)
    assert h["request_inference_time_seconds"].sum == pytest.approx(2.5 + 0.5 + 2.5)
    # TPOT: a 1.5 s over 2 gaps, b-0 one token (0), b-1 2.0 s over 2 gaps
    assert h["request_time_per_output_token_seconds"].sum == pytest.approx(0.75 + 0.0 + 1.0)
    # cumulative buckets: queue times 1.0, 1.5, 1.5 -> le=1.0: 1, le=1.5: 3
    q = h["request_queue_time_seconds"]
    assert q.counts[q.buckets.index(1.0)] == 1 and q.counts[q.buckets.index(1.5)] == 3


def test_forgotten_and_failed_requests() -> None:
    rs = RequestStats(max_model_len=64)
    rs.add_request(["x"], 5, 1, 4, 0.0)
    rs.forget(["x"])
    rs.on_step([RequestDelta("x", [1], finish_reason="length")], now_s=1.0)
    assert rs.snapshot()["request_prompt_tokens"].counts[-1] == 0
    rs.add_request(["y"], 5, 1, 4, 0.0)
    rs.on_step([RequestDelta("y", [], finish_reason="error", error="boom")], now_s=1.0)
    h = rs.snapshot()
    assert h["request_prompt_tokens"].counts[-1] == 1
    assert h["request_generation_tokens"].sum == 0
    assert h["request_queue_time_seconds"].counts[-1] == 0  # no timings without a token
    assert rs.prompt_tokens_computed_total == 0


def test_latency_histograms_per_engine_output() -> None:
    """TTFT, inter-token latency and e2e latency, taken per engine step (they no longer
    depend on how often the caller reads: FINAL_ONLY routes get the same values)."""
    rs = RequestStats(max_model_len=100)
    rs.add_request(["a"], 4, 1, 3, arrival_s=10.0)
    rs.add_request(["b-0", "b-1"], 4, 2, 3, arrival_s=10.5)
    rs.add_request(["gone"], 4, 1, 3, arrival_s=10.0)
    rs.add_request(["bad"], 4, 1, 3, arrival_s=11.0)
    rs.on_step([RequestDelta("a", [1]), RequestDelta("gone", [1])], now_s=12.0)
    rs.forget(["gone"])  # the caller went away: nothing more is observed for it
    rs.on_step([RequestDelta("a", [2]), RequestDelta("b-0", [5]), RequestDelta("b-1", [6]),
                RequestDelta("bad", [], finish_reason="error", error="boom")], now_s=12.5)
    rs.on_step([RequestDelta("a", [3], finish_reason="length"),
                RequestDelta("b-0", [], finish_reason="stop"),
                RequestDelta("b-1", [7]), RequestDelta("gone", [2])], now_s=13.5)
    rs.on_step([RequestDelta("b-1", [8], finish_reason="length")], now_s=14.5)
    h = rs.snapshot()
    ttft, itl, e2e = (h[f"{n}_seconds"] for n in
                      ("time_to_first_token", "inter_token_latency", "e2e_request_latency"))
    # first tokens: a 2.0, gone 2.0 (before it went), b-0 2.0, b-1 2.0
    assert ttft.counts[-1] == 4 and ttft.sum == pytest.approx(8.0)
    assert ttft.counts[ttft.buckets.index(1.0)] == 0 and ttft.counts[ttft.buckets.index(2.5)] == 4
    # gaps: a 0.5 and 1.0; b-1 1.0 and 1.0 (b-0's finish brings no token)
    assert itl.counts[-1] == 4 and itl.sum == pytest.approx(3.5)
    assert itl.counts[itl.buckets.index(0.5)] == 1
    # finished: a 3.5, b-0 3.0, b-1 4.0, bad 1.5 (failed before a token: e2e only)
    assert e2e.counts[-1] == 4 and e2e.sum == pytest.approx(12.0)
    assert e2e.counts[e2e.buckets.index(1.5)] == 1 and e2e.counts[e2e.buckets.index(5.0)] == 4
