"""The CPU sampler's time per call: the C path (`flowengine._cpu_ops.sample_rows`, the
default) against the torch ops (FLOWENGINE_FUSED_SAMPLING=0), by batch rows and kind
of row, on the default model's vocabulary (49,152 tokens).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/cpu_sampler.py [--rows 1 4 16 64] [--threads 2]

Each call follows a 4 ms sleep, as a step's sampling follows its forward, so torch's
intra-op threads have gone to sleep as they do in the engine (the executor sets
OMP_WAIT_POLICY=PASSIVE; set it here too, before torch loads). Prints a markdown table
of the median host ms over --calls calls, the two paths alternated per cell.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import flowengine.sample.sampler as sampler_module
from flowengine.sample.metadata import SamplingState
from flowengine.sample.sampler import Sampler
from flowengine.sampling_params import SamplingParams

KINDS = {
    "greedy": SamplingParams(temperature=0.0),
    "seeded T=1": SamplingParams(temperature=1.0, seed=1),
    "unseeded T=1": SamplingParams(temperature=1.0),
    "T=0.7 top-p 0.95": SamplingParams(temperature=0.7, top_p=0.95),
    "T=0.8 top-k 50": SamplingParams(temperature=0.8, top_k=50),
}


def median_ms(sampler: Sampler, logits: torch.Tensor, states: list[SamplingState],
              calls: int, kernels: bool) -> float:
    sampler_module.FUSED_SAMPLING = kernels
    sampler(logits, states)
    times = []
    for _ in range(calls):
        time.sleep(0.004)
        start = time.perf_counter()
        sampler(logits, states)
        times.append(time.perf_counter() - start)
    times.sort()
    return 1e3 * times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler(seed=0)
    print(f"threads {torch.get_num_threads()}, OMP_WAIT_POLICY "
          f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}, load {os.getloadavg()[0]:.2f}\n")
    print("| rows | kind | C path ms | torch ops ms | speed-up |\n|---|---|---:|---:|---:|")
    for rows in args.rows:
        # A language model's logits are peaked: a scaled normal, a few nats of spread.
        logits = torch.randn(rows, args.vocab, generator=gen) * 3
        for kind, params in KINDS.items():
            states = [SamplingState(params, [1], list(range(20))) for _ in range(rows)]
            c_ms = median_ms(sampler, logits, states, args.calls, True)
            torch_ms = median_ms(sampler, logits, states, args.calls, False)
            print(f"| {rows} | {kind} | {c_ms:.3f} | {torch_ms:.3f} | {torch_ms / c_ms:.1f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
