"""Per-request HTTP overhead: `flowengine serve` with a null engine, two source trees
side by side.

Each round starts `flowengine serve` from tree A, then from tree B (alternating, so
machine load drifts hit both alike), with the deterministic fake engine of
tests/entrypoints/openai_fake_engine.py as its engine (`FLOWENGINE_TEST_ENGINE`
hook, `FAKE_ENGINE_STEP_S=0`: a token per event-loop turn, no model). Against each,
`flowengine bench serve` (this tree's client for both) sends short requests, so what
is measured is the server's HTTP path: parse, validate, route, engine client glue,
SSE/JSON encoding. Prints one row per run and a summary table: requests/s (wall
clock, sensitive to other load on the machine) and the server process's CPU time per
request (user + system, from /proc; much less sensitive to other load).

    python benchmarks/http_overhead.py --tree main=/work/main --tree new=. --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tree: Path, port: int, log: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tree), str(tree / "tests" / "entrypoints")]),
        "FLOWENGINE_TEST_ENGINE": "openai_fake_engine:make_engine",
        "FAKE_ENGINE_STEP_S": "0",
    }
    cmd = [sys.executable, "-m", "flowengine.entrypoints.cli", "serve", "--port", str(port),
           "--disable-log-requests", "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=tree, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server from {tree} did not start; see {log}")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench(port: int, args: argparse.Namespace, result: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    cmd = [sys.executable, "-m", "flowengine.entrypoints.cli", "bench", "serve",
           "--base-url", f"http://127.0.0.1:{port}", "--endpoint", args.endpoint,
           "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--ignore-eos",
           "--max-concurrency", str(args.concurrency), "--disable-tqdm",
           "--result-file", str(result)]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH (give two)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--endpoint", default="/v1/completions")
    args = p.parse_args()
    trees = [(n, Path(t).resolve()) for n, _, t in (x.partition("=") for x in args.tree)]
    rates: dict[str, list[float]] = {name: [] for name, _ in trees}
    cpu_us: dict[str, list[float]] = {name: [] for name, _ in trees}
    print(f"command: python benchmarks/http_overhead.py {' '.join(sys.argv[1:])}")
    print(
        "| round | tree | requests/s | mean E2EL ms | server CPU us/request | load average (1 min) before |"
    )
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, tree in trees:
                port = free_port()
                proc = start_server(tree, port, Path(tmp) / f"{name}-{r}.log")
                try:
                    load = os.getloadavg()[0]
                    cpu0 = cpu_s(proc.pid)
                    rec = bench(port, args, Path(tmp) / "result.json")
                    # The bench's own /tokenize and probe requests are in this too.
                    per_request_us = (cpu_s(proc.pid) - cpu0) / args.num_prompts * 1e6
                finally:
                    proc.terminate()
                    proc.wait(30)
                if rec["failed"]:
                    raise RuntimeError(f"{rec['failed']} requests failed against {name}")
                rates[name].append(rec["request_throughput"])
                cpu_us[name].append(per_request_us)
                print(f"| {r + 1} | {name} | {rec['request_throughput']:.1f} | "
                      f"{rec['latency']['e2el']['mean_ms']:.2f} | {per_request_us:.0f} | "
                      f"{load:.2f} |", flush=True)  # fmt: skip
    print()
    print("| tree | runs | median requests/s | min | max | median server CPU us/request |")
    print("|---|---|---|---|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {len(values)} | {statistics.median(values):.1f} | "
              f"{min(values):.1f} | {max(values):.1f} | "
              f"{statistics.median(cpu_us[name]):.0f} |")  # fmt: skip
    (a, _), (b, _) = trees[:2]
    ratio = statistics.median(rates[b]) / statistics.median(rates[a])
    cpu_ratio = statistics.median(cpu_us[b]) / statistics.median(cpu_us[a])
    print(
        f"\n{b} / {a}: {ratio:.3f}x requests/s, {cpu_ratio:.3f}x server CPU per request (medians)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
