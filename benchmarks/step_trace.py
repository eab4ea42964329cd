"""Join the step traces of a run (flowengine/engine/step_trace.py) into one table.

    FLOWENGINE_STEP_TRACE=/tmp/trace <any engine run>
    python benchmarks/step_trace.py /tmp/trace [--min-rows 128]

For each step N whose neighbours N+1 and N+2 are of the same kind (constrained: its
bitmask came as a GrammarOutput; free: not) and have at least --min-rows rows, the
intervals of the chain that decides when the device can run step N+2's forward:

  ex_resolved N -> sc_result N        step N's tokens: executor resolver -> scheduler
  sc_result N -> sc_updated N         the scheduler's update
  sc_updated N -> sc_grammar_sent N+1 constrained: outputs sent, matchers advanced,
                                      next bitmask filled and sent
  sc_grammar_sent N+1 -> ex_grammar   the bitmask's transit to the executor
  ex_grammar N+1 -> ex_launched N+1   the executor launches step N+1's sampling
  sc_result N -> sc_plan_sent N+2     the scheduler plans N+2 (after the above)
  sc_plan_sent N+2 -> ex_plan N+2     the plan's transit (or the executor still busy)
  ex_plan N+2 -> ex_launched/ex_forward_launched N+2   the executor launches N+2
  ex_resolved N -> ex_resolved N+1    the step period

Prints medians in microseconds per kind.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

CHAIN = [
    ("result transit", "ex_resolved", 0, "sc_result", 0),
    ("scheduler update", "sc_result", 0, "sc_updated", 0),
    ("outputs sent (offload path)", "sc_updated", 0, "sc_outputs_sent", 0),
    ("advance + fill (worker thread)", "sc_outputs_sent", 0, "sc_grammar_done", 0),
    ("update -> bitmask N+1 sent", "sc_updated", 0, "sc_grammar_sent", 1),
    ("bitmask transit", "sc_grammar_sent", 1, "ex_grammar", 1),
    ("executor: sampling N+1 launched", "ex_grammar", 1, "ex_launched", 1),
    ("result N -> plan N+2 sent", "sc_result", 0, "sc_plan_sent", 2),
    ("plan N+2 transit / executor busy", "sc_plan_sent", 2, "ex_plan", 2),
    ("executor: launch N+2 (free)", "ex_plan", 2, "ex_launched", 2),
    ("executor: forward N+2 launched", "ex_plan", 2, "ex_forward_launched", 2),
    ("tokens N -> forward N+2 launched", "ex_resolved", 0, "ex_forward_launched", 2),
    ("tokens N -> launch N+2 (free)", "ex_resolved", 0, "ex_launched", 2),
    ("step period (tokens N -> tokens N+1)", "ex_resolved", 0, "ex_resolved", 1),
]


def load(directory: str) -> tuple[dict[tuple[str, int], int], dict[int, int]]:
    times: dict[tuple[str, int], int] = {}
    rows: dict[int, int] = {}
    for path in glob.glob(os.path.join(directory, "*.json")):
        with open(path) as f:
            for event, step, t_ns, value in json.load(f):
                times.setdefault((event, step), t_ns)
                if event == "ex_plan":
                    rows[step] = value
    return times, rows


def table(times: dict[tuple[str, int], int], rows: dict[int, int], min_rows: int) -> str:
    def kind(step: int) -> str | None:
        if rows.get(step, 0) < min_rows:
            return None
        return "constrained" if ("ex_grammar", step) in times else "free"

    per_kind: dict[str, dict[str, list[float]]] = {}
    for step in sorted(rows):
        k = kind(step)
        if k is None or kind(step + 1) != k or kind(step + 2) != k:
            continue
        cells = per_kind.setdefault(k, {})
        cells.setdefault("steps", []).append(1)
        for name, a, da, b, db in CHAIN:
            ta, tb = times.get((a, step + da)), times.get((b, step + db))
            if ta is not None and tb is not None:
                cells.setdefault(name, []).append((tb - ta) / 1e3)
    kinds = sorted(per_kind)
    out = ["| interval (median us) | " + " | ".join(kinds) + " |",
           "|---|" + "---:|" * len(kinds)]
    out.append("| steps | " + " | ".join(str(len(per_kind[k]["steps"])) for k in kinds) + " |")
    for name, *_ in CHAIN:
        vals = [per_kind[k].get(name) for k in kinds]
        if not any(vals):
            continue
        out.append(f"| {name} | " + " | ".join(
            f"{statistics.median(v):.0f}" if v else "" for v in vals) + " |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("directory")
    p.add_argument("--min-rows", type=int, default=1)
    args = p.parse_args()
    times, rows = load(args.directory)
    print(table(times, rows, args.min_rows))


if __name__ == "__main__":
    main()
