"""Host time of one batch-128 sampling launch on CUDA, piece by piece.

    python benchmarks/sampling_host.py          # on a CUDA machine (DEV=cpu: a dry run)

Times, with the GPU kept busy by large matmuls queued before each call (so no launch
waits for the device), the host side of what `CudaModelRunner._launch_sampling` does
for 128 rows of a 49,152-token vocabulary at temperature 1: the sampling metadata, the
grammar bitmask's apply, the sampler (seeded, unseeded, greedy), the token slots'
update and the copy to the host, plus single kernels for scale. Prints a table of
median and minimum host milliseconds, then torch's profiler table of the CPU time per
op over 10 bitmask + sampling rounds. Issues 12/13: a step's host cost on the H200's
host is its count of torch ops (docs/benchmarks.md, session 32).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from flowengine.executor.pending_step import copy_to_host
from flowengine.sample.grammar_bitmask import apply_plan_bitmask
from flowengine.sample.metadata import SamplingMetadata, SamplingState
from flowengine.sample.sampler import Sampler
from flowengine.sampling_params import SamplingParams

ROWS, VOCAB = 128, 49152


def main() -> None:
    dev = torch.device(os.environ.get("DEV", "cuda"))
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    words = (VOCAB + 31) // 32
    logits = torch.randn(ROWS, VOCAB, device=dev, dtype=torch.bfloat16)
    ids = [str(i) for i in range(ROWS)]
    data = np.random.randint(-2**31, 2**31 - 1, size=(ROWS, words)).astype(np.int32).tobytes()
    last = torch.zeros(512, dtype=torch.int64, device=dev)
    slots = torch.arange(ROWS, device=dev)
    big = torch.randn(8192, 8192, device=dev) if cuda else torch.randn(8, 8)

    def states(**kw) -> list[SamplingState]:
        p = SamplingParams(max_tokens=128, **kw)
        return [SamplingState(p, [], list(range(40))) for _ in range(ROWS)]

    def busy() -> None:  # device work queued first, so no launch below waits for it
        for _ in range(4):
            big @ big

    def timed(label: str, fn: Callable[[], object], n: int = 30) -> None:
        busy()
        fn()
        sync()
        xs = []
        for _ in range(n):
            busy()
            t0 = time.perf_counter()
            fn()
            xs.append(time.perf_counter() - t0)
            sync()
        xs.sort()
        print(f"| {label} | {1e3 * xs[len(xs) // 2]:.3f} | {1e3 * xs[0]:.3f} |")

    sampler = Sampler(seed=0)
    seeded, unseeded = states(temperature=1.0, seed=1), states(temperature=1.0)
    greedy = states(temperature=0.0)
    print(f"| piece (R={ROWS}, V={VOCAB}) | median host ms | min |\n|---|---:|---:|")
    timed("from_states seeded", lambda: SamplingMetadata.from_states(seeded, VOCAB, dev))
    timed("from_states unseeded", lambda: SamplingMetadata.from_states(unseeded, VOCAB, dev))
    masked = logits.clone()
    timed("apply_plan_bitmask", lambda: apply_plan_bitmask(masked, ids, ids, data))
    timed("sampler seeded", lambda: sampler(logits, seeded))
    timed("sampler unseeded", lambda: sampler(logits, unseeded))
    timed("sampler greedy", lambda: sampler(logits, greedy))
    out = sampler(logits, seeded)
    timed("index_copy_", lambda: last.index_copy_(0, slots, out.sampled_token_ids))
    timed("copy_to_host", lambda: copy_to_host(out))
    timed(f"torch.tensor pinned {ROWS} ints", lambda: torch.tensor(
        list(range(ROWS)), dtype=torch.int64, pin_memory=cuda).to(dev, non_blocking=True))
    timed("one small kernel (add_)", lambda: last.add_(1))
    timed("10 small kernels", lambda: [last.add_(1) for _ in range(10)])
    busy()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            step_logits = logits.clone()
            apply_plan_bitmask(step_logits, ids, ids, data)
            copy_to_host(sampler(step_logits, seeded))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
