"""`flowengine bench serve`: load generator for any OpenAI-compatible server.

    flowengine bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --random-input-len 128 --random-output-len 128 --request-rate 4

Streams every request (completions, or chat with `--endpoint /v1/chat/completions`),
with Poisson arrivals at `--request-rate` (inf: all at once) and/or at most
`--max-concurrency` in flight, and prints TTFT, TPOT, ITL and E2E latency, request
and token throughput and goodput with vLLM's definitions (serve_metrics.py), then the
command that produced them. Traffic goes only to the given URL.

`--num-client-processes N` spreads the requests over N client processes (default 1,
in this process, as vLLM's client): one Python process that parses ~90,000 streamed
tokens/s becomes the bottleneck, adding its own delays to TTFT and keeping fewer
requests in flight than `--max-concurrency` (serve_worker.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import time
from dataclasses import asdict
from typing import Any

import httpx
import orjson
from tqdm.auto import tqdm

from flowengine.bench.serve_client import (
    ClientJob,
    build_payload,
    open_client,
    run_load,
    send_request,
)
from flowengine.bench.serve_dataset import (
    BenchRequest,
    jsonl_requests,
    pick_tokenizer,
    random_requests,
)
from flowengine.bench.serve_metrics import (
    METRICS,
    RequestResult,
    compute_metrics,
    format_report,
    parse_goodput,
)
from flowengine.bench.serve_worker import run_client_processes
from flowengine.net import http_url


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowengine bench serve", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions", help="or /v1/chat/completions")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--tokenizer", default=None, help="local HF tokenizer for prompt lengths")
    p.add_argument("--dataset-name", choices=["random", "jsonl"], default="random")
    p.add_argument("--dataset-path", default=None, help='JSONL: {"prompt": ..., "output_len"?: N}')
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="req/s; inf: all at once"
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument(
        "--num-client-processes", type=int, default=1,
        help="client processes sharing the requests, concurrency and rate (default 1, as "
        "vLLM's client); one Python process parsing ~90k streamed tokens/s limits what it measures",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos")
    p.add_argument("--goodput", nargs="+", default=[], help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--result-file", default=None, help="also write the results as JSON")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def _validate(ns: argparse.Namespace) -> tuple[dict[str, float], list[str], list[float]]:
    if ns.request_rate <= 0 or ns.burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    num_procs = ns.num_client_processes
    most = min(ns.max_concurrency or ns.num_prompts, ns.num_prompts)
    if num_procs < 1:
        raise ValueError("--num-client-processes must be >= 1")
    if num_procs > most:
        bound = "--max-concurrency" if most < ns.num_prompts else "--num-prompts"
        raise ValueError(
            f"--num-client-processes {num_procs} exceeds {bound} {most}; "
            "every client process needs a request and a slot to send it: lower it"
        )
    if ns.dataset_name == "jsonl" and not ns.dataset_path:
        raise ValueError("--dataset-name jsonl needs --dataset-path FILE")
    shown = [m for m in ns.percentile_metrics.split(",") if m]
    if unknown := set(shown) - set(METRICS):
        raise ValueError(f"unknown --percentile-metrics {sorted(unknown)}; use {METRICS}")
    percentiles = [float(p) for p in ns.metric_percentiles.split(",") if p]
    if any(not 0 < p <= 100 for p in percentiles):
        raise ValueError("--metric-percentiles must be in (0, 100]")
    return parse_goodput(ns.goodput), shown, percentiles


def _dataset(
    client: httpx.Client, model: str, ns: argparse.Namespace
) -> tuple[list[BenchRequest], str]:
    tokenizer, how = pick_tokenizer(client, model, ns.tokenizer)
    if ns.dataset_name == "jsonl":
        reqs = jsonl_requests(ns.dataset_path, ns.num_prompts, ns.random_output_len, tokenizer)
    else:
        reqs = random_requests(
            tokenizer, ns.num_prompts, ns.random_input_len, ns.random_output_len,
            ns.random_range_ratio, ns.seed,
        )  # fmt: skip
    return reqs, how


async def _run(job: ClientJob, ns: argparse.Namespace) -> tuple[list[RequestResult], float]:
    async with open_client(job) as client:
        # Fail fast (as vLLM does) if the very first request cannot be served.
        first = job.requests[0]
        probe = await send_request(
            client, job.endpoint,
            build_payload(first, job.model, chat=job.is_chat, ignore_eos=False,
                          temperature=job.temperature),
            first.prompt_len,
        )  # fmt: skip
        if not probe.success:
            raise RuntimeError(f"the test request failed: {probe.error}")
        with tqdm(total=len(job.requests), desc="requests", disable=ns.disable_tqdm) as bar:
            if ns.num_client_processes > 1:
                return await run_client_processes(job, ns.num_client_processes, bar.update)
            start = time.perf_counter()
            results = await run_load(client, job, lambda: bar.update(1))
            return results, time.perf_counter() - start


def main(argv: list[str]) -> int:
    """Run the benchmark; prints the table and returns 0 (1 if no request succeeded)."""
    ns = make_parser().parse_args(argv)
    try:
        goodput, shown, percentiles = _validate(ns)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    base_url = (ns.base_url or http_url(ns.host, ns.port)).rstrip("/")
    headers = {"authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    with httpx.Client(base_url=base_url, headers=headers, timeout=60) as client:
        model = ns.model
        if model is None:
            resp = client.get("/v1/models")
            resp.raise_for_status()
            model = resp.json()["data"][0]["id"]
        reqs, how = _dataset(client, model, ns)
    print(f"{len(reqs)} prompts for {model} at {base_url}{ns.endpoint}; token counts from {how}")
    job = ClientJob(
        base_url, headers, ns.endpoint, model, reqs, ns.max_concurrency or len(reqs),
        ns.request_rate, ns.burstiness, ns.seed, ns.ignore_eos, ns.temperature,
    )  # fmt: skip
    results, duration_s = asyncio.run(_run(job, ns))
    metrics = compute_metrics(results, duration_s, goodput, percentiles)
    print(format_report(metrics, shown))
    errors = sorted({r.error for r in results if not r.success})
    for error in errors[:5]:
        print(f"error: {error}")
    command = "flowengine bench serve " + shlex.join(argv)
    print(f"command: {command}")
    if ns.result_file:
        record: dict[str, Any] = {
            "command": command,
            "base_url": base_url,
            "model": model,
            "endpoint": ns.endpoint,
            "request_rate": ns.request_rate,
            "max_concurrency": ns.max_concurrency,
            "num_client_processes": ns.num_client_processes,
            **asdict(metrics),
        }
        with open(ns.result_file, "wb") as f:
            f.write(orjson.dumps(record, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    return 0 if metrics.completed else 1
