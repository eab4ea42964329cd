"""The cost of verifying k draft tokens on the GPU: one verification step (each request
computes its last token + k drafts, LM head on all k + 1 rows) against one plain decode
step, at Llama-3.1-8B shapes with random (load_format="dummy") bf16 weights (issue 16).

    python benchmarks/spec_decode_gpu.py [--k 4] [--batch-sizes 1 64] [--context 1024]

`batch` requests of `context` cached tokens over distinct KV blocks, median of 50 after
5 warm-ups. Two views of each step, both on the runner's own code:

- device: CUDA events around the forward, LM head and argmax on prepared inputs. Plain
  decode: the runner's captured decode graph, and eager. Verification: the runner's
  verification graph (`CudaModelRunner.capture_verification_graphs`, what the engine
  replays for a plan with drafts), and eager (the fallback for shapes without a graph);
- engine step: wall clock of what `CudaModelRunner._forward` does for the step after
  `update_states` (InputBatch.prepare with the runner's padding, one host-to-device
  copy, graph replay), then the LM head over the sampling / verification rows and the
  argmax, until the ids are on the host.

The ratio verification / plain decode bounds the speedup of any proposer: accepting a
tokens per step on average gives at most (1 + a) / ratio. Prints a markdown table
last, with the command and the GPU. --model DIR: another config.json; --device cpu and
a small model debug the script.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_bench import write_model_dir  # noqa: E402

from flowengine.config import CacheConfig  # noqa: E402
from flowengine.executor.cuda_runner import CudaModelRunner  # noqa: E402
from flowengine.executor.input_batch import RequestState  # noqa: E402
from flowengine.model.model_config import ModelConfig  # noqa: E402
from flowengine.sampling_params import SamplingParams  # noqa: E402


def timed_ms(fn, device: torch.device, iters: int = 50, warmup: int = 5) -> float:
    times = []
    for i in range(iters + warmup):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            t = time.perf_counter()
            fn()
            elapsed = (time.perf_counter() - t) * 1e3
        if i >= warmup:
            times.append(elapsed)
    return sorted(times)[len(times) // 2]


def states_for(batch: int, context: int, num_new: int, block_size: int) -> list[RequestState]:
    per_req = (context + num_new) // block_size + 1
    return [RequestState(str(i), [1 + (i + j) % 1000 for j in range(context + num_new)],
                         context, SamplingParams(), None,
                         list(range(i * per_req, (i + 1) * per_req)), context)
            for i in range(batch)]


@torch.inference_mode()
def measure(runner: CudaModelRunner, batch: int, context: int, k: int,
            iters: int = 50) -> dict[str, float]:
    from flowengine.executor.cuda_graphs import padded_batch_size

    model = runner.model
    device = runner.device
    bs = runner.cache_config.block_size
    out: dict[str, float] = {}
    for name, num_new in (("decode", 1), ("verify", k + 1)):
        states = states_for(batch, context, num_new, bs)
        graphs, sizes = ((runner.graphs, runner.decode_batch_sizes) if num_new == 1
                         else (runner.verify_graphs, runner.verify_batch_sizes))
        size = padded_batch_size(batch, sizes) if graphs is not None else None
        kwargs = {} if size is None else (
            {"pad_to": size} if num_new == 1 else {"pad_to": size * num_new,
                                                   "pad_reqs_to": size})
        inputs = runner.input_batch.prepare(states, [num_new] * batch, **kwargs)
        rows = torch.tensor([i * num_new + j for i in range(batch) for j in range(num_new)],
                            dtype=torch.int64, device=device)

        def eager(inputs=inputs, rows=rows) -> None:  # bound: used in this iteration
            hidden = model(inputs.input_ids, inputs.positions, runner.kv_caches,
                           inputs.attn_metadata)
            model.compute_logits(hidden.index_select(0, rows)).argmax(-1)

        out[f"{name}_eager"] = timed_ms(eager, device, iters)
        if size is None:
            continue

        def replay(graphs=graphs, size=size, rows=rows) -> None:
            hidden = graphs.replay(size)
            model.compute_logits(hidden.index_select(0, rows)).argmax(-1)

        out[f"{name}_graph"] = timed_ms(replay, device, iters)

        def engine_step(states=states, graphs=graphs, size=size, kwargs=kwargs,
                        num_new=num_new) -> None:
            runner.input_batch.prepare(states, [num_new] * batch, **kwargs)
            hidden = graphs.replay(size)
            index = torch.tensor([i * num_new + j for i in range(batch)
                                  for j in range(num_new)], dtype=torch.int64)
            index = index.to(device, non_blocking=True)
            model.compute_logits(hidden.index_select(0, index)).argmax(-1).tolist()

        out[f"{name}_engine"] = wall_ms(engine_step, device, iters)
    return out


@torch.inference_mode()
def profile(runner: CudaModelRunner, batch: int, context: int, k: int, out_dir: str) -> None:
    """Kernel tables of the eager decode and verification forwards (LM head + argmax
    included), 10 iterations each, sorted by device time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    os.makedirs(out_dir, exist_ok=True)
    model = runner.model
    for name, num_new in (("decode", 1), ("verify", k + 1)):
        states = states_for(batch, context, num_new, runner.cache_config.block_size)
        inputs = runner.input_batch.prepare(states, [num_new] * batch)
        rows = torch.arange(batch * num_new, dtype=torch.int64, device=runner.device)

        def step(inputs=inputs, rows=rows) -> None:
            hidden = model(inputs.input_ids, inputs.positions, runner.kv_caches,
                           inputs.attn_metadata)
            model.compute_logits(hidden.index_select(0, rows)).argmax(-1)

        for _ in range(3):
            step()
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                step()
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
        path = os.path.join(out_dir, f"profile_{name}_b{batch}.txt")
        with open(path, "w") as f:
            f.write(table)
        print(f"{name} b{batch} profile (10 iterations) -> {path}")
        print("\n".join(table.splitlines()[:16]))


def wall_ms(fn, device: torch.device, iters: int = 50, warmup: int = 5) -> float:
    """Median wall-clock ms of fn() (which ends with a host read), after warm-ups."""
    times = []
    for i in range(iters + warmup):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if i >= warmup:
            times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--model", help="a directory with config.json (default: Llama-3.1-8B shapes)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--profile", metavar="DIR",
                   help="also write torch.profiler kernel tables (CUDA time per kernel) of "
                        "the eager decode and verification forwards at the smallest batch "
                        "size to DIR/profile_{decode,verify}_b{batch}.txt")
    ns = p.parse_args(argv)
    model_dir = ns.model or tempfile.mkdtemp(prefix="llama31-8b-")
    if ns.model is None:
        write_model_dir(model_dir, with_tokenizer=False)
    device = torch.device(ns.device)
    max_batch = max(ns.batch_sizes)
    config = ModelConfig.from_pretrained(model_dir, max_model_len=ns.context + 64)
    bs = 16
    num_blocks = max_batch * ((ns.context + ns.k + 1) // bs + 1) + 8
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    runner = CudaModelRunner(config, CacheConfig(bs, num_blocks), device, dtype, "dummy",
                             max_num_batched_tokens=max_batch * (ns.k + 1),
                             max_num_seqs=max_batch)
    runner.capture_cuda_graphs()
    runner.capture_verification_graphs(ns.k)
    results = {b: measure(runner, b, ns.context, ns.k, ns.iters) for b in ns.batch_sizes}
    if ns.profile:
        profile(runner, min(ns.batch_sizes), ns.context, ns.k, ns.profile)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print()
    print("    python benchmarks/spec_decode_gpu.py " + shlex.join(argv))
    print(f"{gpu}, torch {torch.__version__}, context {ns.context}, k = {ns.k}")
    print()
    nan = float("nan")
    print("| batch | decode graph (ms) | verify graph (ms) | verify / decode, device | "
          "decode engine step (ms) | verify engine step (ms) | verify / decode, engine step "
          "| decode eager (ms) | verify eager (ms) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b, r in results.items():
        dg, vg = r.get("decode_graph", nan), r.get("verify_graph", nan)
        de, ve = r.get("decode_engine", nan), r.get("verify_engine", nan)
        print(f"| {b} | {dg:.2f} | {vg:.2f} | {vg / dg:.2f}x | {de:.2f} | {ve:.2f} | "
              f"{ve / de:.2f}x | {r['decode_eager']:.2f} | {r['verify_eager']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
