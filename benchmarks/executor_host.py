"""Host time of the CUDA executor's step path per request per step, on the CPU.

    python benchmarks/executor_host.py [--requests 256] [--output-len 128] [--profile N]

Issue 12 asks for <= 2 us of host time per request per step in the served executor.
On the GPU that time hides behind the device only while it is shorter than a step,
so it bounds served throughput at large batches. This benchmark runs the same host
code without a GPU: a `CudaModelRunner` on the CPU (its launch/resolve path, input
preparation, sampling metadata, placeholders and token slots) whose model forward and
LM head are replaced by functions returning zeros (vocabulary 512, so the sampler's
device work is small), driven by the core `Scheduler` with two steps in flight, and
the plans and results round-tripped through msgspec as the rings carry them.

Timed per step (decode steps only: every scheduled request computes one token):
  plan:    msgspec decode of the StepPlan (what the executor process receives);
  launch:  `Executor.launch` (update_states, InputBatch.prepare, the null forward,
           SamplingMetadata, sampling, placeholders);
  resolve: `PendingStep.result()` and the msgspec encode of the StepResult;
and the scheduler's own schedule + update_from_output, which runs in the engine
process, for comparison. Prints a table of microseconds per request per step (median
over decode steps at the full batch). --profile N prints cProfile's top N functions
of the executor side.
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

import msgspec
import torch

from flowengine.config import CacheConfig, SchedulerConfig
from flowengine.core.scheduler import Scheduler
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


def run(num_requests: int, prompt_len: int, output_len: int, temperature: float,
        profile: cProfile.Profile | None) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        return _run(_model_config(tmp), num_requests, prompt_len, output_len, temperature,
                    profile)


def _run(model_config: ModelConfig, num_requests: int, prompt_len: int, output_len: int,
         temperature: float, profile: cProfile.Profile | None) -> dict[str, float]:
    max_len = prompt_len + output_len + BLOCK
    blocks = num_requests * (-(-max_len // BLOCK)) + 8
    runner = CudaModelRunner(model_config, CacheConfig(BLOCK, blocks), torch.device("cpu"),
                             torch.float32, load_format="dummy", max_num_batched_tokens=8192,
                             max_num_seqs=num_requests)
    _null_model(runner)
    executor = Executor(runner, Sampler(seed=0))
    scheduler = Scheduler(SchedulerConfig(num_requests, 8192, max_len), CacheConfig(BLOCK, blocks),
                          async_scheduling=True)
    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True)
    for i in range(num_requests):
        prompt = [(7 * i + j) % VOCAB for j in range(prompt_len)]
        scheduler.add_request(Request.from_new_request(
            NewRequest(str(i), prompt, params, 0.0), max_len))
    plan_codec = (msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(StepPlan))
    result_enc = msgspec.msgpack.Encoder()
    timings: dict[str, list[float]] = {k: [] for k in ("plan", "launch", "resolve", "scheduler")}
    in_flight: deque = deque()
    clock = time.perf_counter
    while scheduler.has_unfinished_requests() or in_flight:
        while len(in_flight) < 2:
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
            decode = (len(plan.num_scheduled_tokens) == num_requests
                      and max(plan.num_scheduled_tokens) == 1)
            in_flight.append((plan, handle, decode, t1 - t0, t4 - t3, t5 - t4))
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
    return {k: 1e6 * statistics.median(v) for k, v in timings.items()} | {
        "decode_steps": len(timings["launch"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--profile", type=int, default=0, metavar="N")
    p.add_argument("--json-out")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for r in range(args.runs):
        prof = cProfile.Profile() if args.profile and r == args.runs - 1 else None
        rows.append(run(args.requests, args.prompt_len, args.output_len, args.temperature, prof))
        if prof is not None:
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"\n{args.requests} requests x {args.output_len} decode steps, temperature "
          f"{args.temperature}; load {load}")
    print("| run | plan decode | launch | resolve + result encode | executor total "
          "| scheduler (engine process) |")
    print("|---|---:|---:|---:|---:|---:|")
    for i, t in enumerate(rows):
        total = t["plan"] + t["launch"] + t["resolve"]
        print(f"| {i + 1} | {t['plan']:.2f} | {t['launch']:.2f} | {t['resolve']:.2f} "
              f"| **{total:.2f}** | {t['scheduler']:.2f} |")
    print("(us per request per step, median over full-batch decode steps)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
