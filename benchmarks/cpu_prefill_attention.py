"""CPU prefill attention: the C kernel against PyTorch's SDPA, one step's layers (issue #20).

    python benchmarks/cpu_prefill_attention.py                  # 1 x 128, 16 x 128, 1 x 512
    python benchmarks/cpu_prefill_attention.py --prompts 1x2048 --rounds 5

The default model's attention shapes (SmolLM2-135M: 9 query heads, 3 KV heads,
head_dim 64, 30 layers), float32, fresh prompts of R x N tokens in one step, each layer
with its own cache and block tables scattered over it. Per round and shape, the whole
backend `forward` (the KV write included) of `--layers` layers by the CPU backend (the C
prefill kernel where it runs: AVX2 without AVX-512) and by the torch reference (one
causal SDPA call per run of equal prompts, PyTorch's CPU flash-attention kernel),
alternated; prints the median ms per step of each, their ratio and the largest
difference of the outputs, with the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import flowengine  # noqa: F401  (sets the wait policy before torch loads threads)
from flowengine.model.attention.cpu_backend import CpuAttentionBackend, _prefill_kernel_on
from flowengine.model.attention.metadata import AttentionMetadata
from flowengine.model.attention.torch_backend import TorchAttentionBackend

BLOCK = 16


def step(backend, meta_args: tuple, layers: list, d: int) -> tuple[float, list[torch.Tensor]]:
    """One step's attention over every layer: (ms, the layers' outputs)."""
    outs = []
    t0 = time.perf_counter()
    # one metadata object per step, shared by its layers, as in the engine
    meta = AttentionMetadata(*meta_args)
    for cache, q, k, v in layers:
        outs.append(backend.forward(q, k, v, cache, meta, d ** -0.5))
    return (time.perf_counter() - t0) * 1e3, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="1x128,16x128,1x512",
                    help="comma-separated RxN: R prompts of N tokens")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head_dim")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    hq, hkv, d = (int(v) for v in a.heads.split(","))
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    print(f"load average {os.getloadavg()[0]:.2f}; {a.layers} layers, heads {hq}/{hkv}, "
          f"head_dim {d}, {a.threads} threads; C prefill kernel on: {_prefill_kernel_on()}")
    print("| prompts | SDPA (reference) ms/step | C kernel ms/step | SDPA / C | max abs diff |")
    print("|---|---:|---:|---:|---:|")
    for spec in a.prompts.split(","):
        r, n = (int(v) for v in spec.split("x"))
        nbl = -(-n // BLOCK)
        blocks = r * nbl + 4
        qsl = torch.arange(r + 1, dtype=torch.int32) * n
        seq_lens = torch.full((r,), n, dtype=torch.int32)
        # one block table for the step (as the engine's: every layer's cache has the
        # same block ids), the blocks scattered
        bt = torch.randperm(blocks)[:r * nbl].view(r, nbl).to(torch.int32)
        pos = torch.arange(n)
        slots = torch.cat([bt[i].long()[pos // BLOCK] * BLOCK + pos % BLOCK for i in range(r)])
        layers = [(torch.zeros(2, blocks, BLOCK, hkv, d), torch.randn(r * n, hq, d),
                   torch.randn(r * n, hkv, d), torch.randn(r * n, hkv, d))
                  for _ in range(a.layers)]

        meta_args = (qsl, seq_lens, bt, slots, n, n, qsl, seq_lens)
        ref_b, c_b = TorchAttentionBackend(), CpuAttentionBackend()
        step(ref_b, meta_args, layers, d)
        step(c_b, meta_args, layers, d)
        t_ref, t_c = [], []
        diff = 0.0
        for _ in range(a.rounds):
            t, o_ref = step(ref_b, meta_args, layers, d)
            t_ref.append(t)
            t, o_c = step(c_b, meta_args, layers, d)
            t_c.append(t)
            diff = max(diff, max((x - y).abs().max().item() for x, y in zip(o_ref, o_c, strict=True)))
        mr, mc = statistics.median(t_ref), statistics.median(t_c)
        print(f"| {r} x {n} | {mr:.2f} | {mc:.2f} | {mr / mc:.2f} | {diff:.1e} |")
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
