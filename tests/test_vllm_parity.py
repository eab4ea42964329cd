"""The vLLM parity table of docs/serving.md is true to the code and complete.

Three sources must agree:
- tests/vllm_reference.json: vLLM's serve flags, SamplingParams fields, LLM methods and
  metrics (transcribed from vLLM's source; the commits are in the file);
- the table in docs/serving.md ("## vLLM parity"): one row per vLLM item, with its
  status same / different / missing and FlowEngine's name;
- the code: the `flowengine serve` parser, `SamplingParams`, `LLM`, the metrics.

A failure names the row to change: when you add a flag, field, method or metric, flip
its row (or add it to "Only in FlowEngine").
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = json.loads((ROOT / "tests" / "vllm_reference.json").read_text())
SECTIONS = {
    "`vllm serve` flags": "serve_flags",
    "`SamplingParams` fields": "sampling_params",
    "`LLM` methods": "llm_methods",
    "Metrics": "metrics",
}
STATUSES = {"same", "different", "missing"}
KINDS = {"serve_flags": "flag", "sampling_params": "field", "llm_methods": "method",
         "metrics": "metric"}


def _cells(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [c.strip().replace("\\|", "|") for c in cells]


def _code(cell: str) -> str | None:
    if cell == "—":
        return None
    match = re.fullmatch(r"`([^`]+)`", cell)
    assert match, f"expected `name` or —, got {cell!r}"
    return match.group(1)


def parse_table() -> tuple[dict[str, list[tuple[str, str, str | None]]], list[tuple[str, str]]]:
    """{section key: [(vllm name, status, flowengine name)]}, [(kind, flowengine name)]."""
    text = (ROOT / "docs" / "serving.md").read_text()
    body = text.split("\n## vLLM parity\n", 1)[1].split("\n## ", 1)[0]
    tables: dict[str, list[tuple[str, str, str | None]]] = {}
    only: list[tuple[str, str]] = []
    for block in body.split("\n### ")[1:]:
        title, *lines = block.split("\n")
        rows = [_cells(x) for x in lines if x.startswith("|")][2:]  # header, rule
        if title == "Only in FlowEngine":
            only = [(kind, _code(name)) for kind, name, _ in rows]
            continue
        key = SECTIONS[title]
        tables[key] = [(_code(v), status, _code(ours)) for v, status, ours, _ in rows]
    assert set(tables) == set(SECTIONS.values())
    return tables, only


TABLES, ONLY = parse_table()


def _ours() -> dict[str, dict[str, set[str]]]:
    """What the code has, per section: {canonical name: {every name it answers to}}."""
    from flowengine import LLM, SamplingParams
    from flowengine.engine.protocol import EngineStats
    from flowengine.entrypoints.openai.server import make_parser
    from flowengine.metrics import ServingMetrics

    flags = {}
    for action in make_parser()._actions:
        if action.option_strings and action.dest != "help":
            long = [o for o in action.option_strings if o.startswith("--")]
            flags[long[0]] = set(action.option_strings)
    metrics = {}
    for family in ServingMetrics(EngineStats, "m").registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        metrics[name] = {name}
    return {
        "serve_flags": flags,
        "sampling_params": {f: {f} for f in SamplingParams.__struct_fields__},
        "llm_methods": {m: {m} for m in dir(LLM) if not m.startswith("_")},
        "metrics": metrics,
    }


OURS = _ours()


@pytest.mark.parametrize("key", sorted(SECTIONS.values()))
def test_one_row_per_vllm_item_in_reference_order(key: str) -> None:
    assert [v for v, _, _ in TABLES[key]] == REFERENCE[key]["names"]
    assert all(REFERENCE[key]["sources"])  # each list says where it was read


@pytest.mark.parametrize("key", sorted(SECTIONS.values()))
def test_statuses_match_the_code(key: str) -> None:
    answers = {alias: name for name, aliases in OURS[key].items() for alias in aliases}
    wrong = []
    for vllm_name, status, ours in TABLES[key]:
        if status not in STATUSES:
            wrong.append(f"{vllm_name}: status {status!r} is not one of {sorted(STATUSES)}")
        elif status == "missing":
            mapped = vllm_name.replace("vllm:", "flowengine:")
            if ours is not None or mapped in answers:
                wrong.append(f"{vllm_name}: marked missing, but the code has it; make it "
                             "same or different")
        elif ours is None or ours not in answers:
            wrong.append(f"{vllm_name}: marked {status} as {ours!r}, which the code lacks")
        elif status == "same" and ours != vllm_name.replace("vllm:", "flowengine:"):
            wrong.append(f"{vllm_name}: 'same' must keep vLLM's name, not {ours!r}")
    assert wrong == []


@pytest.mark.parametrize("key", sorted(SECTIONS.values()))
def test_everything_flowengine_has_is_listed(key: str) -> None:
    listed = {ours for _, status, ours in TABLES[key] if status != "missing"}
    listed |= {name for kind, name in ONLY if kind == KINDS[key]}
    unlisted = [name for name, aliases in OURS[key].items() if not aliases & listed]
    assert unlisted == [], "add these to the table (a vLLM row or 'Only in FlowEngine')"
    only_here = {name for kind, name in ONLY if kind == KINDS[key]}
    assert only_here <= set(OURS[key]), "an 'Only in FlowEngine' entry the code lacks"
    assert not only_here & {v for v, _, _ in TABLES[key]}, "vLLM has it: use its row"
