"""Scale-out on the CPU (issue #18): DP=2 against DP=1 at concurrency 16, and the
per-step overhead that pipeline parallelism adds (--pp-overhead).

    nice -n 10 python benchmarks/scale_out.py                 # default model, 2 rounds
    python benchmarks/scale_out.py --sizes 1 2 --num-requests 64 --rounds 3 --out x.json
    nice -n 10 python benchmarks/scale_out.py --pp-overhead   # PP=1 against PP=2

--pp-overhead: a near-null model (random-weight Llama, hidden 64, 2 layers: its
forward is well under a millisecond, so a step's time is the engine's own) served by
`AsyncEngine(pipeline_parallel_size=N)` (multiproc: one engine process, N executor
processes); per round, `--pp-batch` sizes of requests decode `--output-len` tokens
each; ms per step = elapsed / output tokens per request (prefill is one step of a
few tokens). The difference to PP=1 is what the stage hand-over costs per step (a
torch.distributed send/recv of the hidden states, one more process on the ring, and
the sampled tokens travelling back in the next plan).

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
from flowengine.sampling_params import RequestOutputKind


def _load() -> float:
    return os.getloadavg()[0]


async def _one(engine: AsyncEngine, prompt: list[int], params: SamplingParams,
               gate: asyncio.Semaphore) -> int:
    async with gate:
        num_tokens = 0
        # DELTA: each output holds only its new tokens (CUMULATIVE would count them again).
        async for out in engine.submit(prompt, params, output_kind=RequestOutputKind.DELTA):
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


def _null_model(dirname: str) -> str:
    """A config.json of a random-weight Llama small enough to cost nothing per step,
    with the default model's tokenizer (served with load_format "dummy")."""
    import shutil

    from transformers import LlamaConfig

    from flowengine.config import EngineArgs
    from flowengine.engine.builder import resolve

    LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                architectures=["LlamaForCausalLM"]).save_pretrained(dirname)
    default = resolve(EngineArgs()).model_path
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(default, name), dirname)
    return dirname


async def pp_overhead(args: argparse.Namespace) -> list[dict]:
    import tempfile

    model = _null_model(tempfile.mkdtemp(prefix="fe-pp-null-"))
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engines = {}
    for size in args.pp_sizes:
        engine = AsyncEngine(model, pipeline_parallel_size=size, placement="multiproc",
                             load_format="dummy", max_model_len=args.output_len + 64,
                             disable_log_stats=True)
        await engine.start()
        await _round(engine, [[rng.randrange(1000, 40000) for _ in range(8)]] * 2,
                     params, 2)  # warm-up
        engines[size] = engine
    rows = []
    try:
        for r in range(args.rounds):
            for batch in args.pp_batch:
                for size, engine in engines.items():
                    prompts = [[rng.randrange(1000, 40000) for _ in range(8)]
                               for _ in range(batch)]
                    load = _load()
                    elapsed_s, num_tokens = await _round(engine, prompts, params, batch)
                    rows.append(dict(round=r, pipeline_parallel_size=size, batch=batch,
                                     load_1m=load, elapsed_s=elapsed_s,
                                     ms_per_step=1000 * elapsed_s / args.output_len,
                                     output_tokens_per_s=num_tokens / elapsed_s))
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        for engine in engines.values():
            await engine.shutdown(drain_timeout_s=5)
    return rows


def _pp_table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [f"`{' '.join(shlex.quote(a) for a in ['python', *sys.argv])}`", "",
             f"near-null model (Llama, hidden 64, 2 layers, dummy weights), {args.output_len} "
             f"output tokens per request, {os.cpu_count()} CPUs", "",
             "| round | requests | PP | load (1 min) | ms/step | output tok/s | ms/step over PP=1 |",
             "|---|---|---|---|---|---|---|"]
    base = {(r["round"], r["batch"]): r["ms_per_step"] for r in rows
            if r["pipeline_parallel_size"] == 1}
    for row in rows:
        ref = base.get((row["round"], row["batch"]))
        delta = "" if ref is None or row["pipeline_parallel_size"] == 1 else \
            f"{row['ms_per_step'] - ref:+.2f}"
        lines.append(f"| {row['round']} | {row['batch']} | {row['pipeline_parallel_size']} | "
                     f"{row['load_1m']:.2f} | {row['ms_per_step']:.2f} | "
                     f"{row['output_tokens_per_s']:.1f} | {delta} |")
    return "\n".join(lines)


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
    parser.add_argument("--pp-overhead", action="store_true",
                        help="measure the per-step overhead of pipeline parallelism instead")
    parser.add_argument("--pp-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--pp-batch", type=int, nargs="+", default=[1, 8],
                        help="concurrent requests per --pp-overhead round")
    ns = parser.parse_args()
    if ns.pp_overhead:
        ns.output_len = ns.output_len if "--output-len" in sys.argv else 128
    result = asyncio.run(pp_overhead(ns) if ns.pp_overhead else main(ns))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)
    print(_pp_table(result, ns) if ns.pp_overhead else _table(result, ns))
