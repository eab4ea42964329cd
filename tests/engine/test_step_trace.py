"""Step traces (flowengine/engine/step_trace.py, FLOWENGINE_STEP_TRACE): each process's
marks land in one file at dump, and benchmarks/step_trace.py joins two processes'
files into the per-step chain (intervals computed from exact, made-up timestamps)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import orjson

from flowengine.engine import step_trace

ROOT = Path(__file__).resolve().parents[2]


def test_marks_are_dumped_per_process(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FLOWENGINE_STEP_TRACE", str(tmp_path / "trace"))
    trace = importlib.reload(step_trace)
    try:
        assert trace.ENABLED
        trace.start("engine0")
        trace.mark("sc_plan_sent", 7)
        trace.mark("ex_plan", 7, 128)
        path = trace.dump()
        events = orjson.loads(Path(path).read_bytes())
        assert Path(path).name.startswith("engine0-")
        assert [e[:2] + e[3:] for e in events] == [["sc_plan_sent", 7, 0], ["ex_plan", 7, 128]]
        assert events[0][2] <= events[1][2]
        assert trace.dump() is None  # nothing left to write
    finally:
        monkeypatch.delenv("FLOWENGINE_STEP_TRACE")
        importlib.reload(step_trace)
    assert not step_trace.ENABLED and step_trace.dump() is None


def test_the_join_gives_each_interval(tmp_path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        joiner = importlib.import_module("step_trace")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    us = 1000  # ns
    executor, engine = [], []
    for n in range(5):  # free steps of 4 rows, one every 100 us
        t = n * 100 * us
        executor += [["ex_plan", n, t, 4], ["ex_launched", n, t + 10 * us, 0],
                     ["ex_resolved", n, t + 60 * us, 0]]
        engine += [["sc_plan_sent", n, t - 5 * us, 0], ["sc_result", n, t + 70 * us, 0],
                   ["sc_updated", n, t + 73 * us, 0]]
    (tmp_path / "executor0-1.json").write_text(json.dumps(executor))
    (tmp_path / "engine0-2.json").write_text(json.dumps(engine))
    table = joiner.table(*joiner.load(str(tmp_path)), min_rows=4)
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1].rstrip(" |")
            for line in table.splitlines()[2:]}
    assert rows["steps"] == "3"  # steps 0-2 have two same-kind successors
    assert rows["result transit"] == "10"
    assert rows["scheduler update"] == "3"
    assert rows["executor: launch N+2 (free)"] == "10"
    assert rows["step period (tokens N -> tokens N+1)"] == "100"
    assert "constrained" not in table.splitlines()[0]
