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

--verify-attention unified decode (the default) measures both routings of the
verification step's attention side by side in one process (triton_backend.py's
FLOWENGINE_VERIFY_ATTENTION): one set of verification graphs captured under each, and
the decode step, the unified-kernel verification and the split-KV verification timed
in turn, --repeats rounds (the table gives the mean of the rounds' medians, the log
every round). A second table times the attention launch alone at the same shapes: 32
launches (one per layer) captured in a CUDA graph, per-launch µs from the replay.
"""

from __future__ import annotations

import argparse
import json
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
def measure(runner: CudaModelRunner, batch: int, context: int, num_new: int,
            iters: int = 50) -> dict[str, float]:
    """eager / graph / engine ms of one step with `num_new` tokens per request (1: plain
    decode on runner.graphs; k + 1: verification on runner.verify_graphs)."""
    from flowengine.executor.cuda_graphs import padded_batch_size

    model = runner.model
    device = runner.device
    bs = runner.cache_config.block_size
    out: dict[str, float] = {}
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

    def eager() -> None:
        hidden = model(inputs.input_ids, inputs.positions, runner.kv_caches,
                       inputs.attn_metadata)
        model.compute_logits(hidden.index_select(0, rows)).argmax(-1)

    out["eager"] = timed_ms(eager, device, iters)
    if size is None:
        return out

    def replay() -> None:
        hidden = graphs.replay(size)
        model.compute_logits(hidden.index_select(0, rows)).argmax(-1)

    out["graph"] = timed_ms(replay, device, iters)

    def engine_step() -> None:
        runner.input_batch.prepare(states, [num_new] * batch, **kwargs)
        hidden = graphs.replay(size)
        index = torch.tensor([i * num_new + j for i in range(batch)
                              for j in range(num_new)], dtype=torch.int64)
        index = index.to(device, non_blocking=True)
        model.compute_logits(hidden.index_select(0, index)).argmax(-1).tolist()

    out["engine"] = wall_ms(engine_step, device, iters)
    return out


@torch.inference_mode()
def attention_alone(config: ModelConfig, batch: int, context: int, k: int,
                    device: torch.device, iters: int = 50,
                    layers: int = 32) -> dict[str, float]:
    """µs per launch of the attention kernels alone at the model's head shapes, bf16
    cache of distinct random blocks: the plain decode step (split-KV decode kernel, q =
    1), and the verification step (q = k + 1) on the unified kernel and on the split-KV
    kernel with packed tokens. `layers` launches are captured in one CUDA graph (split
    counts as the runner's graphs fix them), the replay timed; each launch reads its own
    layer's cache when memory allows, else one cache (then partly from L2)."""
    from flowengine.kernels.decode_attention import choose_num_kv_splits, decode_attention
    from flowengine.kernels.paged_attention import paged_attention

    hq, hkv, hd, bs = config.num_heads, config.num_kv_heads, config.head_dim, 16
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    per_req = (context + k + 1) // bs + 1
    num_blocks = batch * per_req + 1
    caches = [torch.randn(2, num_blocks, bs, hkv, hd, dtype=dtype, device=device)
              for _ in range(layers if batch * context <= 64 * 1024 else 1)]
    tables = torch.randperm(batch * per_req, device=device).to(torch.int32).view(batch, per_req)
    scale = hd ** -0.5
    splits = choose_num_kv_splits(batch, hkv, config.max_model_len, device)
    out: dict[str, float] = {}
    for name, q in (("decode_q1", 1), ("verify_unified", k + 1), ("verify_splitkv", k + 1)):
        query = torch.randn(batch * q, hq, hd, dtype=dtype, device=device)
        res = torch.empty_like(query)
        qsl = torch.arange(0, batch * q + 1, q, dtype=torch.int32, device=device)
        seq_lens = torch.full((batch,), context + q, dtype=torch.int32, device=device)

        def launch(cache: torch.Tensor, name=name, q=q, query=query, res=res, qsl=qsl,
                   seq_lens=seq_lens) -> None:
            if name == "verify_unified":
                paged_attention(query, cache, qsl, seq_lens, tables, max_query_len=q,
                                scale=scale, out=res)
            else:
                decode_attention(query, cache, qsl, seq_lens, tables,
                                 max_seq_len=config.max_model_len, scale=scale,
                                 num_kv_splits=splits, out=res, max_query_len=q)

        def stack() -> None:
            for i in range(layers):
                launch(caches[i % len(caches)])

        stack()  # compiles
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                stack()
            out[name] = timed_ms(graph.replay, device, iters) * 1e3 / layers
        else:
            out[name] = timed_ms(stack, device, max(1, iters // 10), 1) * 1e3 / layers
    out["num_kv_splits"] = splits
    return out


@torch.inference_mode()
def profile(runner: CudaModelRunner, batch: int, context: int, k: int, out_dir: str,
            kinds: tuple[str, ...] = ("decode", "verify"), suffix: str = "") -> None:
    """Kernel tables of the eager decode and verification forwards (LM head + argmax
    included), 10 iterations each, sorted by device time, under the verification
    routing in force (named by `suffix`)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    os.makedirs(out_dir, exist_ok=True)
    model = runner.model
    for name, num_new in (("decode", 1), ("verify", k + 1)):
        if name not in kinds:
            continue
        if name == "verify":
            name += suffix
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
    from flowengine.model.attention import triton_backend

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--model", help="a directory with config.json (default: Llama-3.1-8B shapes)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=2,
                   help="rounds of (decode, each verification routing) per batch size")
    p.add_argument("--verify-attention", nargs="+", choices=["unified", "decode"],
                   default=["unified", "decode"],
                   help="verification attention routings to compare (FLOWENGINE_VERIFY_"
                        "ATTENTION): unified kernel, split-KV decode kernel")
    p.add_argument("--profile", metavar="DIR",
                   help="also write torch.profiler kernel tables (CUDA time per kernel) of "
                        "the eager decode and verification forwards (each routing) at the "
                        "smallest batch size to DIR/profile_{decode,verify_ROUTING}_b{batch}.txt")
    p.add_argument("--json", metavar="PATH", help="also write every round's numbers as JSON")
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
    # Graphs of the measured sizes only (no padding either way; less capture time).
    runner = CudaModelRunner(config, CacheConfig(bs, num_blocks), device, dtype, "dummy",
                             max_num_batched_tokens=max_batch * (ns.k + 1),
                             max_num_seqs=max_batch,
                             capture_sizes=sorted(set(ns.batch_sizes)))
    runner.capture_cuda_graphs()
    verify_graphs = {}
    for routing in ns.verify_attention:
        triton_backend.VERIFY_ATTENTION = routing
        runner.capture_verification_graphs(ns.k)
        verify_graphs[routing] = runner.verify_graphs
    rounds: dict[int, list[dict[str, dict[str, float]]]] = {}
    for b in ns.batch_sizes:
        rounds[b] = []
        for _ in range(ns.repeats):  # alternated: decode, then each routing, per round
            # (keys: "plain" for the decode step, "verify_<routing>" per routing)
            r = {"plain": measure(runner, b, ns.context, 1, ns.iters)}
            for routing in ns.verify_attention:
                triton_backend.VERIFY_ATTENTION = routing
                runner.verify_graphs = verify_graphs[routing]
                r[f"verify_{routing}"] = measure(runner, b, ns.context, ns.k + 1, ns.iters)
            rounds[b].append(r)
            print(f"batch {b}: {json.dumps(r)}", flush=True)
    alone = {b: attention_alone(config, b, ns.context, ns.k, device, ns.iters)
             for b in ns.batch_sizes}
    print(f"attention alone: {json.dumps(alone)}", flush=True)
    if ns.profile:
        for i, routing in enumerate(ns.verify_attention):
            triton_backend.VERIFY_ATTENTION = routing
            profile(runner, min(ns.batch_sizes), ns.context, ns.k, ns.profile,
                    kinds=("decode", "verify") if i == 0 else ("verify",),
                    suffix=f"_{routing}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"rounds": rounds, "attention_alone": alone}, f, indent=1)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    def mean(b: int, kind: str, view: str) -> float:
        vals = [r[kind].get(view, float("nan")) for r in rounds[b]]
        return sum(vals) / len(vals)

    print()
    print("    python benchmarks/spec_decode_gpu.py " + shlex.join(argv))
    print(f"{gpu}, torch {torch.__version__}, context {ns.context}, k = {ns.k}, "
          f"mean of {ns.repeats} rounds' medians of {ns.iters}")
    print()
    print("| batch | verification attention | decode graph (ms) | verify graph (ms) | "
          "verify / decode, device | decode engine step (ms) | verify engine step (ms) | "
          "verify / decode, engine step | decode eager (ms) | verify eager (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for b in ns.batch_sizes:
        dg, de, dx = (mean(b, "plain", v) for v in ("graph", "engine", "eager"))
        for routing in ns.verify_attention:
            vg, ve, vx = (mean(b, f"verify_{routing}", v) for v in ("graph", "engine", "eager"))
            label = "unified kernel" if routing == "unified" else "split-KV decode kernel"
            print(f"| {b} | {label} | {dg:.2f} | {vg:.2f} | {vg / dg:.3f}x | {de:.2f} | "
                  f"{ve:.2f} | {ve / de:.3f}x | {dx:.2f} | {vx:.2f} |")
    print()
    print("Attention launch alone (µs per launch, 32 launches in one CUDA graph; "
          f"{config.num_heads} query / {config.num_kv_heads} KV heads, head_dim "
          f"{config.head_dim}, context {ns.context}):")
    print()
    print(f"| batch | KV splits | decode, q = 1 | verify q = {ns.k + 1}, unified | "
          f"verify q = {ns.k + 1}, split-KV packed |")
    print("|---|---|---|---|---|")
    for b, a in alone.items():
        print(f"| {b} | {a['num_kv_splits']} | {a['decode_q1']:.1f} | "
              f"{a['verify_unified']:.1f} | {a['verify_splitkv']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
