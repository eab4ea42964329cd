"""Whole-step host time per decode step at batch 1 with the model replaced by a null one.

    python benchmarks/cpu_step_overhead.py [--steps 512] [--batch 1]

What remains is FlowEngine's own per-step cost on the CPU: scheduling, the StepPlan,
the runner's input preparation (InputBatch), sampling (greedy, one request), the result
and the scheduler's update (EngineCore.step), then the same through LLM.generate
(detokenization and outputs included). The model's forward and LM head are replaced
by functions that return zeros of the right shapes; the configuration is the default
model's (30 layers, vocabulary 49152), so the sampler sees real-size logits. Prints a
table: mean and median milliseconds per step and per generated token. Issue #20's
target: < 1 ms per decode step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import flowengine  # noqa: F401  (sets the wait policy before torch loads)
from flowengine import LLM, SamplingParams


def null_model(llm: LLM) -> None:
    runner = llm.engine.executor.runner
    model = runner.model
    hidden, vocab = model.config.hidden_size, model.config.vocab_size

    def forward(input_ids, positions, kv_caches, meta):
        return torch.zeros(input_ids.shape[0], hidden)

    def compute_logits(h):
        return torch.zeros(h.shape[0], vocab)

    model.forward = forward
    model.compute_logits = compute_logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args()
    llm = LLM(load_format="dummy", max_model_len=4096, enable_prefix_caching=False,
              placement="inproc")
    null_model(llm)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(100 + i, 132 + i))} for i in range(args.batch)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                 use_tqdm=False)  # warm-up

    core = llm.engine
    step = core.step
    times: list[float] = []

    def timed_step():
        t0 = time.perf_counter()
        deltas = step()
        times.append(time.perf_counter() - t0)
        return deltas

    core.step = timed_step
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    generate_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    times = times[1:]  # the prefill step
    load = os.getloadavg()[0]
    print(f"# python {' '.join(os.sys.argv)}  (load average {load:.2f}, "
          f"{torch.get_num_threads()} threads)")
    print("| path | mean ms/step | median ms/step |")
    print("|---|---|---|")
    ms = [t * 1e3 for t in times]
    print(f"| EngineCore.step, batch {args.batch} | {statistics.mean(ms):.3f} | "
          f"{statistics.median(ms):.3f} |")
    print(f"| LLM.generate per step (incl. prefill, detokenize), batch {args.batch} | "
          f"{generate_ms:.3f} | - |")


if __name__ == "__main__":
    main()
