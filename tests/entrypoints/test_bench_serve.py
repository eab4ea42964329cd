"""`flowengine bench serve`: metric definitions (exact values), prompts, arrivals, runs
against a live server with the fake engine, in one and in several client processes."""

from __future__ import annotations

import asyncio
import random

import orjson
import pytest
from openai_fake_engine import FakeEngine
from openai_live_server import LiveServer

from flowengine.bench import serve, serve_client, serve_worker
from flowengine.bench.serve import main
from flowengine.bench.serve_client import ClientJob
from flowengine.bench.serve_dataset import (
    BenchRequest,
    WordTokenizer,
    jsonl_requests,
    random_requests,
)
from flowengine.bench.serve_metrics import (
    RequestResult,
    compute_metrics,
    format_report,
    parse_goodput,
)
from flowengine.bench.serve_worker import WorkerExit, merge_reports, split_job

RESULTS = [
    RequestResult(True, 10, 5, ttft_s=0.1, latency_s=0.5, itl_s=[0.1, 0.1, 0.1, 0.1]),
    RequestResult(True, 20, 1, ttft_s=0.2, latency_s=0.2),
    RequestResult(False, 30, 0, error="HTTP 500"),
]


def test_metrics_follow_vllm_definitions():
    m = compute_metrics(RESULTS, duration_s=2.0, percentiles=(50.0, 99.0))
    assert (m.completed, m.failed, m.total_input, m.total_output) == (2, 1, 30, 6)
    assert (m.request_throughput, m.output_throughput, m.total_token_throughput) == (1.0, 3.0, 18.0)
    assert m.request_goodput is None
    ttft = m.latency["ttft"]
    assert (ttft.mean_ms, ttft.median_ms, ttft.std_ms) == pytest.approx((150.0, 150.0, 50.0))
    assert ttft.percentiles_ms == pytest.approx({50.0: 150.0, 99.0: 199.0})
    # TPOT = (E2E - TTFT) / (output_tokens - 1), only for requests with > 1 token.
    assert m.latency["tpot"].mean_ms == pytest.approx(100.0)
    assert m.latency["tpot"].percentiles_ms[99.0] == pytest.approx(100.0)
    assert m.latency["itl"].mean_ms == pytest.approx(100.0)
    assert m.latency["e2el"].mean_ms == pytest.approx(350.0)


def test_goodput_counts_requests_meeting_every_slo():
    assert compute_metrics(RESULTS, 2.0, {"ttft": 150.0}).request_goodput == 0.5
    assert compute_metrics(RESULTS, 2.0, {"ttft": 250.0}).request_goodput == 1.0
    # r2's TPOT counts as 0 (one token) but its TTFT misses; r1's TPOT (100 ms) misses.
    assert compute_metrics(RESULTS, 2.0, {"ttft": 150.0, "tpot": 50.0}).request_goodput == 0.0
    assert compute_metrics(RESULTS, 2.0, {"e2el": 300.0}).request_goodput == 0.5
    assert parse_goodput(["ttft:200", "tpot:5.5"]) == {"ttft": 200.0, "tpot": 5.5}
    for bad in (["itl:3"], ["ttft"], ["ttft:x"], ["e2el:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_report_table():
    text = format_report(compute_metrics(RESULTS, 2.0, {"ttft": 150.0}), ["ttft", "e2el"])
    lines = text.splitlines()
    assert lines[0] == "=" * 12 + " Serving Benchmark Result " + "=" * 12
    rows = {line[:40].strip(): line[41:].rstrip() for line in lines if line[40:41] == " "}
    assert rows["Request goodput (req/s):"] == "0.50"
    assert rows["Total generated tokens:"] == "6"
    assert rows["Mean TTFT (ms):"] == "150.00"
    assert rows["P99 E2EL (ms):"] == "497.00"
    assert lines[-1] == "=" * 50
    assert not any("TPOT" in line for line in lines)


def test_arrivals_use_gamma_gaps(monkeypatch):
    gaps: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        gaps.append(seconds)

    monkeypatch.setattr(serve_client.asyncio, "sleep", fake_sleep)
    reqs = [BenchRequest("p", 1, 1)] * 4

    async def collect(rate: float, burstiness: float) -> int:
        return len([r async for r in serve_client.arrivals(reqs, rate, burstiness, seed=3)])

    assert asyncio.run(collect(float("inf"), 1.0)) == 4 and gaps == []
    asyncio.run(collect(4.0, 2.0))
    rng = random.Random(3)
    assert gaps == [rng.gammavariate(2.0, 1.0 / 8.0) for _ in range(3)]


def test_random_and_jsonl_prompts(tmp_path):
    words = WordTokenizer()
    reqs = random_requests(words, 5, input_len=12, output_len=7, seed=1)
    assert [(len(r.prompt.split()), r.prompt_len, r.output_len) for r in reqs] == [(12, 12, 7)] * 5
    assert reqs == random_requests(WordTokenizer(), 5, 12, 7, seed=1)
    ranged = random_requests(words, 50, input_len=10, output_len=10, range_ratio=0.5, seed=2)
    assert {r.prompt_len for r in ranged} <= set(range(5, 16)) and len(
        {r.prompt_len for r in ranged}
    ) > 3
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "a b c"}\n\n{"prompt": "d", "output_len": 3}\n')
    assert jsonl_requests(path, 3, 9, words) == [
        BenchRequest("a b c", 3, 9), BenchRequest("d", 1, 3), BenchRequest("a b c", 3, 9)
    ]  # fmt: skip
    path.write_bytes(b'{"text": "x"}\n')
    with pytest.raises(ValueError, match="'prompt' string"):
        jsonl_requests(path, 1, 9, words)


def test_bench_against_live_server(tmp_path, capsys):
    engine = FakeEngine(step_s=0.002)
    result_file = tmp_path / "result.json"
    with LiveServer(engine) as live:
        argv = [
            "--base-url", live.base_url, "--num-prompts", "12", "--random-input-len", "16",
            "--random-output-len", "8", "--request-rate", "200", "--ignore-eos",
            "--goodput", "e2el:60000", "--result-file", str(result_file), "--disable-tqdm",
        ]  # fmt: skip
        assert main(argv) == 0
        chat = ["--base-url", live.base_url, "--endpoint", "/v1/chat/completions",
                "--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "3",
                "--max-concurrency", "2", "--disable-tqdm"]  # fmt: skip
        assert main(chat) == 0
    out = capsys.readouterr().out
    assert "token counts from the server's /tokenize" in out
    assert f"command: flowengine bench serve --base-url {live.base_url} --num-prompts 12" in out
    record = orjson.loads(result_file.read_bytes())
    # The byte tokenizer makes prompt lengths exact: 16 tokens in, 8 out, 12 requests.
    assert (record["completed"], record["failed"]) == (12, 0)
    assert (record["total_input"], record["total_output"]) == (12 * 16, 12 * 8)
    assert record["request_goodput"] == pytest.approx(record["request_throughput"])
    completion_params = [p for rid, _, p in engine.submitted if rid.startswith("cmpl-")]
    assert len(completion_params) == 13  # the probe request plus 12
    assert all(
        p.ignore_eos and p.max_tokens == 8 and p.temperature == 0 for p in completion_params[1:]
    )
    assert out.count("Successful requests:") == 2


def test_bench_fails_fast_when_the_server_refuses():
    with LiveServer(FakeEngine()) as live:
        with pytest.raises(RuntimeError, match="test request failed: HTTP 404"):
            main(["--base-url", live.base_url, "--model", "nope", "--num-prompts", "2",
                  "--random-input-len", "4", "--disable-tqdm"])  # fmt: skip
    assert main(["--request-rate", "0"]) == 2


def test_client_processes_match_one_process(tmp_path, monkeypatch):
    measured: list[list[RequestResult]] = []

    def spy(results, *args):
        measured.append(list(results))
        return compute_metrics(results, *args)

    monkeypatch.setattr(serve, "compute_metrics", spy)
    engine = FakeEngine(step_s=0.002)
    records, prompts = [], []
    with LiveServer(engine) as live:
        for num_procs in (1, 2, 3):
            engine.submitted.clear()
            engine.peak_running = 0
            result_file = tmp_path / f"n{num_procs}.json"
            argv = [
                "--base-url", live.base_url, "--num-prompts", "11", "--random-input-len", "16",
                "--random-range-ratio", "0.5", "--random-output-len", "8", "--ignore-eos",
                "--max-concurrency", "4", "--num-client-processes", str(num_procs),
                "--result-file", str(result_file), "--disable-tqdm",
            ]  # fmt: skip
            assert main(argv) == 0
            records.append(orjson.loads(result_file.read_bytes()))
            prompts.append(sorted(p for _, p, _ in engine.submitted[1:]))  # after the probe
            assert len(engine.submitted) == 1 + 11
            assert 1 <= engine.peak_running <= 4
    one = measured[0]
    # The range ratio varies the lengths, so equal lists below mean the same request order.
    assert len({r.prompt_len for r in one}) > 3 and len({r.output_tokens for r in one}) > 3
    for results, record, sent in zip(measured[1:], records[1:], prompts[1:], strict=True):
        assert [(r.success, r.prompt_len, r.output_tokens) for r in results] == [
            (r.success, r.prompt_len, r.output_tokens) for r in one
        ]
        assert sent == prompts[0]
        counts = ("completed", "failed", "total_input", "total_output")
        assert [record[k] for k in counts] == [records[0][k] for k in counts]
    assert [r["num_client_processes"] for r in records] == [1, 2, 3]
    assert (records[0]["completed"], records[0]["failed"]) == (11, 0)


def _job(num_requests: int, max_concurrency: int, rate: float = 6.0) -> ClientJob:
    reqs = [BenchRequest(f"p{i}", 10 + i, 4) for i in range(num_requests)]
    return ClientJob("http://127.0.0.1:9", {}, "/v1/completions", "m", reqs, max_concurrency,
                     rate, 1.0, 7, False, 0.0)  # fmt: skip


def test_split_job_deals_requests_round_robin():
    shares = split_job(_job(7, 5), 3)
    assert [[r.prompt for r in s.requests] for s in shares] == [
        ["p0", "p3", "p6"], ["p1", "p4"], ["p2", "p5"]
    ]  # fmt: skip
    assert [(s.max_concurrency, s.request_rate, s.seed) for s in shares] == [
        (2, 2.0, 7), (2, 2.0, 8), (1, 2.0, 9)
    ]  # fmt: skip


def test_merge_reports_of_broken_workers():
    reqs = _job(7, 7).requests
    ok = RequestResult(True, 10, 4, ttft_s=0.1, latency_s=0.4, itl_s=[0.1, 0.1, 0.1])
    good = orjson.dumps({"start_time": 100.5, "end_time": 103.0, "results": [ok] * 3})
    exits = [
        WorkerExit(0, good, b""),
        WorkerExit(0, good[:40], b""),  # cut short
        WorkerExit(3, b"", b"Traceback (most recent call last):\nRuntimeError: boom\n"),
    ]
    results, duration_s = merge_reports(reqs, exits, start_time=100.0, end_time=109.0)
    assert duration_s == 2.5
    assert [r.success for r in results] == [True, False, False] * 2 + [True]
    assert [r.prompt_len for r in results] == [10, 11, 12, 10, 14, 15, 10]
    assert results[1].error.startswith("client process sent a bad report (JSONDecodeError")
    assert results[2].error == (
        "client process exited with code 3: Traceback (most recent call last):\n"
        "RuntimeError: boom"
    )
    _, duration_s = merge_reports(reqs[:1], exits[2:], start_time=100.0, end_time=109.0)
    assert duration_s == 9.0


def test_client_process_that_cannot_start(monkeypatch):
    monkeypatch.setattr(serve_worker, "WORKER_MODULE", "flowengine.bench.no_such_worker")
    done: list[int] = []
    results, _ = asyncio.run(serve_worker.run_client_processes(_job(5, 2), 2, done.append))
    assert [r.prompt_len for r in results] == [10, 11, 12, 13, 14]
    assert all(
        not r.success
        and r.error.startswith("client process exited with code 1: ")
        and "No module named flowengine.bench.no_such_worker" in r.error
        for r in results
    )
    assert sorted(done) == [2, 3]


def test_too_many_client_processes(capsys):
    assert main(["--num-client-processes", "3", "--max-concurrency", "2"]) == 2
    assert main(["--num-client-processes", "3", "--num-prompts", "2"]) == 2
    assert main(["--num-client-processes", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "error: --num-client-processes 3 exceeds --max-concurrency 2; every client process "
        "needs a request and a slot to send it: lower it",
        "error: --num-client-processes 3 exceeds --num-prompts 2; every client process "
        "needs a request and a slot to send it: lower it",
        "error: --num-client-processes must be >= 1",
    ]
