"""Host time of the CUDA executor's step path per request per step, on the CPU.

    python benchmarks/executor_host.py [--requests 256] [--output-len 128] [--profile N]
    python benchmarks/executor_host.py --requests 64,128,256 --pad --mixed --runs 5

Issue 12 asks for <= 2 us of host time per request per step in the served executor.
On the GPU that time hides behind the device only while it is shorter than a step,
so it bounds served throughput at large batches. This benchmark runs the same host
code without a GPU: a `CudaModelRunner` on the CPU (its launch/resolve path, input
preparation, sampling metadata, placeholders and token slots) whose model forward and
LM head are replaced by functions returning zeros (vocabulary 512, so the sampler's
device work is small), driven by the core `Scheduler` with two steps in flight, and
the plans and results round-tripped through msgspec as the rings carry them.

Timed per step (decode steps only: every scheduled request computes one token; with
--mixed, also the mixed steps: every decode plus one chunk of a new request's prompt):
  plan:    msgspec decode of the StepPlan (what the executor process receives);
  launch:  `Executor.launch` (update_states, InputBatch.prepare, the null forward,
           SamplingMetadata, sampling, placeholders);
  resolve: `PendingStep.result()` and the msgspec encode of the StepResult;
and the scheduler's own schedule + update_from_output, which runs in the engine
process, for comparison. Prints a table of microseconds per request per step (median
over decode steps at the full batch). --profile N prints cProfile's top N functions
of the executor side.

--pad pads decode steps to the CUDA graph sizes (`decode_batch_sizes`) and mixed steps to
the mixed graph sizes, as a runner with captured graphs does; --mixed adds, whenever
none waits, a request of --mixed-prompt-len prompt tokens and one output token, whose
prompt is prefilled in chunks beside the decodes (token budget: requests + --mixed-chunk).
--requests takes a list (one table row group per size); --runs repeats each size and the
table shows every run and the best (lowest) of them.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import torch

from flowengine.config import CacheConfig, SchedulerConfig
from flowengine.core.scheduler import Scheduler
from flowengine.executor.cuda_graphs import CAPTURE_SIZES, mixed_capture_sizes
from flowengine.executor.cuda_runner import CudaModelRunner
from flowengine.executor.executor import Executor
from flowengine.messages import NewRequest, StepPlan, StepResult
from flowengine.model.model_config import ModelConfig
from flowengine.request import Request
from flowengine.sample.sampler import Sampler
from flowengine.sampling_params import SamplingParams

BLOCK = 16
VOCAB = 512


def _model_config(path: str) -> ModelConfig:
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                eos_token_id=None, bos_token_id=None,
                architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return ModelConfig.from_pretrained(path)


def _null_model(runner: CudaModelRunner) -> None:
    hidden = runner.model_config.hidden_size

    def forward(input_ids, positions, kv_caches, meta):  # noqa: ARG001
        return torch.zeros(input_ids.shape[0], hidden)

    def compute_logits(h):
        return torch.zeros(h.shape[0], VOCAB)

    runner.model.forward = forward
    runner.model.compute_logits = compute_logits


@dataclass(frozen=True)
class Workload:
    num_requests: int
    prompt_len: int
    output_len: int
    temperature: float
    pad: bool = False  # pad steps to the CUDA graph sizes
    mixed_prompt_len: int = 0  # 0: no mixed steps
    mixed_chunk: int = 256


def run(w: Workload, profile: cProfile.Profile | None) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        return _run(_model_config(tmp), w, profile)


def _run(model_config: ModelConfig, w: Workload,
         profile: cProfile.Profile | None) -> dict[str, float]:
    num_requests = w.num_requests
    max_len = max(w.prompt_len + w.output_len, w.mixed_prompt_len + 1) + BLOCK
    max_seqs = num_requests + (1 if w.mixed_prompt_len else 0)
    budget = 8192 if not w.mixed_prompt_len else num_requests + w.mixed_chunk
    blocks = max_seqs * (-(-max_len // BLOCK)) + 8
    runner = CudaModelRunner(model_config, CacheConfig(BLOCK, blocks), torch.device("cpu"),
                             torch.float32, load_format="dummy", max_num_batched_tokens=8192,
                             max_num_seqs=max_seqs)
    _null_model(runner)
    if w.pad:
        runner.decode_batch_sizes = list(runner.capture_sizes)
        runner.mixed_sizes = mixed_capture_sizes(max_seqs, 8192, CAPTURE_SIZES)
    executor = Executor(runner, Sampler(seed=0))
    scheduler = Scheduler(SchedulerConfig(max_seqs, budget, max_len),
                          CacheConfig(BLOCK, blocks), async_scheduling=True)
    params = SamplingParams(temperature=w.temperature, max_tokens=w.output_len, ignore_eos=True)
    for i in range(num_requests):
        prompt = [(7 * i + j) % VOCAB for j in range(w.prompt_len)]
        scheduler.add_request(Request.from_new_request(
            NewRequest(str(i), prompt, params, 0.0), max_len))
    one_token = SamplingParams(temperature=w.temperature, max_tokens=1, ignore_eos=True)
    num_mixed_added = 0
    plan_codec = (msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(StepPlan))
    result_enc = msgspec.msgpack.Encoder()
    timings: dict[str, list[float]] = {
        k: [] for k in ("plan", "launch", "resolve", "scheduler", "mixed_launch")}
    in_flight: deque = deque()
    clock = time.perf_counter
    decoding = True
    while scheduler.has_unfinished_requests() or in_flight:
        while len(in_flight) < 2:
            if w.mixed_prompt_len and decoding and not scheduler.waiting:
                # A long prompt prefilled in chunks beside the decodes.
                prompt = [(13 * num_mixed_added + j) % VOCAB for j in range(w.mixed_prompt_len)]
                scheduler.add_request(Request.from_new_request(
                    NewRequest(f"m{num_mixed_added}", prompt, one_token, 0.0), max_len))
                num_mixed_added += 1
            t0 = clock()
            plan = scheduler.schedule()
            t1 = clock()
            if not plan.num_scheduled_tokens:
                break
            if profile is not None:
                profile.enable()
            wire = plan_codec[0].encode(plan)
            t3 = clock()
            received = plan_codec[1].decode(wire)
            t4 = clock()
            handle = executor.launch(received)
            t5 = clock()
            if profile is not None:
                profile.disable()
            counts = plan.num_scheduled_tokens
            decode = len(counts) == num_requests and max(counts) == 1
            mixed = len(counts) == num_requests + 1 and max(counts) > 1
            decoding = len(counts) >= num_requests
            if mixed:
                timings["mixed_launch"].append((t5 - t4) / len(counts))
            in_flight.append((plan, handle, decode, t1 - t0, t4 - t3, t5 - t4))
        if not in_flight:
            break
        plan, handle, decode, sched_s, plan_s, launch_s = in_flight.popleft()
        if profile is not None:
            profile.enable()
        t0 = clock()
        result = handle.result()
        result_enc.encode(result)
        t1 = clock()
        if profile is not None:
            profile.disable()
        msgspec.msgpack.decode(result_enc.encode(result), type=StepResult)
        t2 = clock()
        scheduler.update_from_output(plan, result)
        t3 = clock()
        if decode:
            n = num_requests
            timings["plan"].append(plan_s / n)
            timings["launch"].append(launch_s / n)
            timings["resolve"].append((t1 - t0) / n)
            timings["scheduler"].append((sched_s + t3 - t2) / n)
    return {k: 1e6 * statistics.median(v) if v else float("nan")
            for k, v in timings.items()} | {
        "decode_steps": len(timings["launch"]), "mixed_steps": len(timings["mixed_launch"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", default="256", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--profile", type=int, default=0, metavar="N")
    p.add_argument("--pad", action="store_true", help="pad steps to the CUDA graph sizes")
    p.add_argument("--mixed", action="store_true", help="add prefill chunks to decode steps")
    p.add_argument("--mixed-prompt-len", type=int, default=2048)
    p.add_argument("--mixed-chunk", type=int, default=256)
    p.add_argument("--json-out")
    args = p.parse_args()
    torch.set_num_threads(1)
    sizes = [int(n) for n in args.requests.split(",")]
    rows: dict[int, list[dict[str, float]]] = {n: [] for n in sizes}
    for r in range(args.runs):
        for n in sizes:  # sizes interleaved, so a load change hits all of them
            prof = cProfile.Profile() if args.profile and r == args.runs - 1 else None
            w = Workload(n, args.prompt_len, args.output_len, args.temperature, args.pad,
                         args.mixed_prompt_len if args.mixed else 0, args.mixed_chunk)
            rows[n].append(run(w, prof))
            if prof is not None:
                pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"\n{args.requests} requests x {args.output_len} decode steps, temperature "
          f"{args.temperature}, pad {args.pad}, mixed {args.mixed}; load {load}")
    print("| requests | run | plan decode | launch | resolve + result encode | executor total "
          "| launch us/step | mixed launch (per row) | scheduler (engine process) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for n, runs in rows.items():
        best = {k: min(t[k] for t in runs) for k in runs[0]}
        for i, t in enumerate([*runs, best]):
            name = "best" if i == len(runs) else str(i + 1)
            total = t["plan"] + t["launch"] + t["resolve"]
            print(f"| {n} | {name} | {t['plan']:.2f} | {t['launch']:.2f} | {t['resolve']:.2f} "
                  f"| **{total:.2f}** | {t['launch'] * n:.0f} | {t['mixed_launch']:.2f} "
                  f"| {t['scheduler']:.2f} |")
    print("(us per request per step, median over full-batch decode steps; launch us/step = "
          "launch x requests; mixed launch: per row of the mixed steps)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
