"""examples/grafana/flowengine.json queries only metrics that FlowEngine exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from flowengine.engine.protocol import EngineStats
from flowengine.metrics import ServingMetrics

DASHBOARD = Path(__file__).resolve().parents[1] / "examples" / "grafana" / "flowengine.json"


def _exported() -> set[str]:
    """Every sample name /metrics can carry: families plus their suffixes."""
    names = set()
    for family in ServingMetrics(EngineStats, "m").registry.collect():
        base = family.name
        if family.type == "counter":
            names.add(base + "_total")
        elif family.type == "histogram":
            names |= {base + s for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(base)
    return names


def _queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_every_queried_metric_exists() -> None:
    exported = _exported()
    used = {m for e in _queries() for m in re.findall(r"flowengine:[a-zA-Z0-9_:]+", e)}
    assert used and sorted(used - exported) == []


def test_the_vllm_request_metrics_have_panels() -> None:
    used = " ".join(_queries())
    for name in ("request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "request_params_n",
                 "request_params_max_tokens", "cache_config_info", "prompt_tokens_total"):
        assert f"flowengine:{name}" in used, name
