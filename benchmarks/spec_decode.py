"""n-gram speculative decoding on the CPU: TPOT at concurrency 1 and throughput at
concurrency 16, with and without `speculative_config`, engines alternated (issue 16).

    python benchmarks/spec_decode.py [--output-len 128] [--reps 3] [--k 4]
        [--lookup-min 2] [--lookup-max 4] [--concurrency 1 16]

Workload (quotes its input): the default model (SmolLM2-135M-Instruct) rewrites a real
source file (benchmarks/data/stop_checker.py.txt, a copy of flowengine/core/stop_checker.py)
with one function renamed. The prompt is a plain completion: the old file, then the new
file's header (naming the rename) and its first line, so the model goes on writing the
new file. (Asked through its chat template, this 135M model does not quote the file at
all: it writes "# TODO: add your own code here" and unrelated text, so n-gram drafts
have nothing to match; that was the workload of the first measurement.) Greedy, exactly
`output_len` tokens (ignore_eos). At concurrency c, c such requests (each renaming a
different function name, so prompts differ) are submitted at once to `LLM.generate`.
Both engines are built first and then run alternately (base, spec, base, spec, ...);
prefix caching is off in both, so every rep prefills. TPOT = (wall time - first step)
/ (output tokens - 1) per request at concurrency 1 (the first step is the prefill);
throughput = output tokens / wall time. Acceptance length = 1 + accepted / drafts
(vLLM's mean acceptance length). The token ids of both engines are checked equal.
Prints a markdown table last, with the load averages before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from flowengine import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
SOURCE = (ROOT / "benchmarks" / "data" / "stop_checker.py.txt").read_text()
NEW_NAMES = ["stop_status", "finished_status", "should_stop", "end_check", "check_end",
             "stop_rule", "halt_status", "is_done", "done_status", "stop_test",
             "check_finish", "finish_check", "ends_here", "stop_reason_of", "status_after",
             "stop_now"]


def prompt(i: int) -> str:
    name = NEW_NAMES[i % len(NEW_NAMES)]
    first = SOURCE.split("\n", 1)[0]
    return (f"<file name=old.py>\n{SOURCE}</file>\n"
            f"<file name=new.py note=\"check_stop renamed to {name}\">\n{first}\n")


def timed(llm: LLM) -> list[float]:
    core = llm.engine
    steps: list[float] = []
    step = core.step

    def timed_step():
        t = time.perf_counter()
        out = step()
        steps.append(time.perf_counter() - t)
        return out

    core.step = timed_step
    return steps


def run(llm: LLM, steps: list[float], concurrency: int, output_len: int
        ) -> tuple[float, float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    steps.clear()
    t = time.perf_counter()
    outs = llm.generate([prompt(i) for i in range(concurrency)], params, use_tqdm=False)
    wall = time.perf_counter() - t
    ids = [o.outputs[0].token_ids for o in outs]
    assert all(len(x) == output_len for x in ids)
    tpot = (wall - steps[0]) / (output_len - 1)
    return tpot, concurrency * output_len / wall, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    load_before = os.getloadavg()
    spec_config = {"method": "ngram", "num_speculative_tokens": args.k,
                   "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}
    # In process: the steps are timed and the scheduler's stats read.
    engines = {"no spec": LLM(enable_prefix_caching=False, placement="inproc"),
               "ngram": LLM(enable_prefix_caching=False, speculative_config=spec_config,
                            placement="inproc")}
    timers = {name: timed(llm) for name, llm in engines.items()}
    results: dict[tuple[int, str], list[tuple[float, float]]] = {}
    accept: dict[int, tuple[int, int]] = {}
    for c in args.concurrency:
        before = engines["ngram"].engine.scheduler.make_stats()
        ref_ids = None
        for rep in range(args.reps):
            for name, llm in engines.items():
                tpot, tput, ids = run(llm, timers[name], c, args.output_len)
                if ref_ids is None:
                    ref_ids = ids
                assert ids == ref_ids, f"{name} rep {rep}: token ids differ from no spec"
                results.setdefault((c, name), []).append((tpot, tput))
                print(f"c={c} rep={rep} {name}: TPOT {tpot * 1e3:.1f} ms, {tput:.1f} tok/s",
                      flush=True)
        after = engines["ngram"].engine.scheduler.make_stats()
        accept[c] = (after.spec_decode_num_drafts_total - before.spec_decode_num_drafts_total,
                     after.spec_decode_num_accepted_tokens_total
                     - before.spec_decode_num_accepted_tokens_total)
    load_after = os.getloadavg()
    print()
    print("    " + " ".join(["python benchmarks/spec_decode.py", f"--output-len {args.output_len}",
                             f"--reps {args.reps}", f"--k {args.k}",
                             f"--lookup-min {args.lookup_min}", f"--lookup-max {args.lookup_max}",
                             "--concurrency", *map(str, args.concurrency)]))
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    print()
    print("| concurrency | engine | TPOT median (ms) | throughput median (tok/s) | "
          "TPOT ratio | throughput ratio | acceptance length |")
    print("|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        base_tpot = statistics.median(t for t, _ in results[(c, "no spec")])
        base_tput = statistics.median(x for _, x in results[(c, "no spec")])
        for name in engines:
            tpot = statistics.median(t for t, _ in results[(c, name)])
            tput = statistics.median(x for _, x in results[(c, name)])
            drafts, accepted = accept[c]
            length = f"{1 + accepted / drafts:.2f}" if name == "ngram" and drafts else "—"
            print(f"| {c} | {name} | {tpot * 1e3:.1f} | {tput:.1f} | {base_tpot / tpot:.2f}x | "
                  f"{tput / base_tput:.2f}x | {length} |")


if __name__ == "__main__":
    main()
