"""Data parallelism on the CPU (issue #18): DP=2 against DP=1 at concurrency 16.

    nice -n 10 python benchmarks/scale_out.py                 # default model, 2 rounds
    python benchmarks/scale_out.py --sizes 1 2 --num-requests 64 --rounds 3 --out x.json

For each data-parallel size, one `AsyncEngine(data_parallel_size=N)` (multiproc: one
engine and one executor process per replica; DP=1 is the same pipeline with one
replica), then per round `--num-requests` requests of `--input-len` random token ids
and `--output-len` tokens (greedy, ignore_eos) at `--concurrency` in flight: requests/s,
output tokens/s, and how many requests each replica got. Rounds of the sizes alternate
(1, 2, 1, 2, ...) after a warm-up, so a busy neighbour hurts both alike; every row
carries the 1-minute load average at its start. Prints a markdown table (and the
command) last; JSON to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import time

from flowengine import SamplingParams
from flowengine.entrypoints.async_engine import AsyncEngine


def _load() -> float:
    return os.getloadavg()[0]


async def _one(engine: AsyncEngine, prompt: list[int], params: SamplingParams,
               gate: asyncio.Semaphore) -> int:
    async with gate:
        num_tokens = 0
        async for out in engine.submit(prompt, params):
            num_tokens += len(out.outputs[0].token_ids)
        return num_tokens


async def _round(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams,
                 concurrency: int) -> tuple[float, int]:
    gate = asyncio.Semaphore(concurrency)
    start = time.perf_counter()
    counts = await asyncio.gather(*(_one(engine, p, params, gate) for p in prompts))
    return time.perf_counter() - start, sum(counts)


async def main(args: argparse.Namespace) -> list[dict]:
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.input_len)]
               for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engines = {}
    for size in args.sizes:
        engine = AsyncEngine(args.model, data_parallel_size=size, placement="multiproc",
                             max_model_len=args.input_len + args.output_len + 16,
                             disable_log_stats=True)
        await engine.start()
        await _round(engine, prompts[: 2 * size], params, 2 * size)  # warm-up
        engines[size] = engine
    rows = []
    try:
        for r in range(args.rounds):
            for size, engine in engines.items():
                load = _load()
                router = getattr(engine, "router", None)
                before = [x.num_routed_total for x in router.replicas] if router else [0]
                elapsed_s, num_tokens = await _round(engine, prompts, params, args.concurrency)
                after = [x.num_routed_total for x in router.replicas] if router else \
                    [len(prompts)]
                rows.append(dict(round=r, data_parallel_size=size, load_1m=load,
                                 elapsed_s=elapsed_s, requests_per_s=len(prompts) / elapsed_s,
                                 output_tokens_per_s=num_tokens / elapsed_s,
                                 per_replica=[a - b for a, b in zip(after, before, strict=True)]))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for engine in engines.values():
            await engine.shutdown(drain_timeout_s=5)
    return rows


def _table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [f"`{' '.join(shlex.quote(a) for a in ['python', *sys.argv])}`", "",
             f"{args.num_requests} requests x {args.input_len} in / {args.output_len} out, "
             f"concurrency {args.concurrency}, {os.cpu_count()} CPUs", "",
             "| round | DP | load (1 min) | req/s | output tok/s | requests per replica |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['round']} | {row['data_parallel_size']} | {row['load_1m']:.2f} | "
                     f"{row['requests_per_s']:.2f} | {row['output_tokens_per_s']:.1f} | "
                     f"{row['per_replica']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    ns = parser.parse_args()
    result = asyncio.run(main(ns))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)
    print(_table(result, ns))
