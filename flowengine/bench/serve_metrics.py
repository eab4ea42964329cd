"""Serving-benchmark metrics with the definitions of vLLM's serving benchmark.

Source: vLLM `benchmarks/serve.py` (`calculate_metrics`), so numbers compare directly:

- TTFT: time from sending the request to the first streamed chunk with content.
- TPOT (time per output token, excluding the first): (E2E - TTFT) / (output_tokens - 1),
  per request, for requests with more than one output token.
- ITL (inter-token latency): every gap between consecutive content chunks, pooled
  over all requests.
- E2E latency: time from sending the request to its last content chunk.
- Throughputs divide totals by the benchmark duration (first send to last finish).
- Goodput: requests per second that met every given SLO (`ttft`, `tpot`, `e2el`, in
  ms; a request's TPOT is 0 when it has at most one output token, as in vLLM).
Percentiles use numpy's default linear interpolation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


@dataclass
class RequestResult:
    """What the client measured for one request (seconds, token counts)."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


@dataclass
class LatencyStats:
    """Mean, median, standard deviation and the asked percentiles, in ms."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: dict[float, float]

    @classmethod
    def of(cls, values_s: Sequence[float], percentiles: Sequence[float]) -> LatencyStats:
        ms = np.asarray(values_s, dtype=np.float64) * 1000.0
        if ms.size == 0:
            return cls(0.0, 0.0, 0.0, {p: 0.0 for p in percentiles})
        return cls(
            float(ms.mean()),
            float(np.median(ms)),
            float(ms.std()),
            {p: float(np.percentile(ms, p)) for p in percentiles},
        )


@dataclass
class BenchmarkMetrics:
    """Totals, throughputs (per second) and latency statistics of one run."""

    completed: int
    failed: int
    duration_s: float
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    latency: dict[str, LatencyStats]


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` → {"ttft": 200.0, "tpot": 50.0} (milliseconds).

    Raises ValueError naming the bad item and the allowed metric names.
    """
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"bad --goodput item {item!r}; use ttft:MS, tpot:MS or e2el:MS")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"bad --goodput value in {item!r}; give milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r} must be >= 0 ms")
    return slos


def compute_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    goodput_ms: dict[str, float] | None = None,
    percentiles: Sequence[float] = (99.0,),
) -> BenchmarkMetrics:
    """Aggregate per-request results (see the module docstring for definitions)."""
    ok = [r for r in results if r.success]
    ttfts = [r.ttft_s for r in ok]
    e2els = [r.latency_s for r in ok]
    itls = [gap for r in ok for gap in r.itl_s]
    all_tpots = [
        (r.latency_s - r.ttft_s) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0 for r in ok
    ]
    tpots = [t for t, r in zip(all_tpots, ok, strict=True) if r.output_tokens > 1]
    goodput = None
    if goodput_ms:
        per_request = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        good = sum(
            all(per_request[name][i] * 1000.0 <= slo for name, slo in goodput_ms.items())
            for i in range(len(ok))
        )
        goodput = good / duration_s
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(ok) / duration_s,
        request_goodput=goodput,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        latency={
            name: LatencyStats.of(values, percentiles)
            for name, values in zip(METRICS, (ttfts, tpots, itls, e2els), strict=True)
        },
    )


def format_report(m: BenchmarkMetrics, shown: Sequence[str] = METRICS) -> str:
    """The result table, laid out like vLLM's."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: object) -> None:
        text = f"{value:<10.2f}" if isinstance(value, float) else f"{value:<10}"
        lines.append(f"{label:<40} {text}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Benchmark duration (s):", m.duration_s)
    row("Total input tokens:", m.total_input)
    row("Total generated tokens:", m.total_output)
    row("Request throughput (req/s):", m.request_throughput)
    if m.request_goodput is not None:
        row("Request goodput (req/s):", m.request_goodput)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Total token throughput (tok/s):", m.total_token_throughput)
    for name in shown:
        title, short = TITLES[name]
        stats = m.latency[name]
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        row(f"Mean {short} (ms):", stats.mean_ms)
        row(f"Median {short} (ms):", stats.median_ms)
        for p, value in stats.percentiles_ms.items():
            row(f"P{p:g} {short} (ms):", value)
    lines.append("=" * 50)
    return "\n".join(lines)
