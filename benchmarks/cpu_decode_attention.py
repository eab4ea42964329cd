"""CPU decode attention alone, one decode step's worth of layers (issue #20).

    python benchmarks/cpu_decode_attention.py                     # 1, 4, 16 requests
    python benchmarks/cpu_decode_attention.py --requests 16 --context 228 --rounds 30

The default model's attention shapes (SmolLM2-135M: 9 query heads, 3 KV heads,
head_dim 64), a bf16 cache of 16-position blocks scattered at random in one cache per
layer (30 layers, so a step reads each layer's blocks once, as a decode step does), float32
queries: the `--dtype bfloat16` decode path (`paged_decode_attention`, the C kernel);
`--cache-dtype float32` the float32 path's cache, `float16` a `--kv-cache-dtype float16` one.
Per request count: `--rounds` steps of `--layers` calls, after one warm-up step; prints
the min and median ms per step and the K/V bytes a step reads, with the load average.
Compare trees by running it with each one's PYTHONPATH, alternated.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import flowengine  # noqa: F401  (sets the wait policy before torch loads threads)
from flowengine.model.attention.cpu_backend import paged_decode_attention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", default="1,4,16", help="comma-separated request counts")
    ap.add_argument("--context", type=int, default=228, help="positions per request")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head_dim")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dtype", choices=("bfloat16", "float16", "float32"),
                    default="bfloat16",
                    help="float32: the float32 decode path's cache")
    a = ap.parse_args()
    hq, hkv, d = (int(v) for v in a.heads.split(","))
    cache_dtype = getattr(torch, a.cache_dtype)
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    print(f"load average {os.getloadavg()[0]:.2f}; {a.layers} layers, context {a.context}, "
          f"heads {hq}/{hkv}, head_dim {d}, {a.cache_dtype} cache, {a.threads} threads")
    print("| requests | min ms/step | median ms/step | K/V MB read per step |")
    print("|---:|---:|---:|---:|")
    for reqs in (int(r) for r in a.requests.split(",")):
        nbl = -(-a.context // a.block_size)
        caches, tables = [], []
        for _ in range(a.layers):
            blocks = reqs * nbl + 8
            caches.append(torch.randn(2, blocks, a.block_size, hkv, d).to(cache_dtype))
            tables.append(torch.randperm(blocks)[:reqs * nbl].view(reqs, nbl)
                          .to(torch.int32).contiguous())
        seq_lens = torch.full((reqs,), a.context, dtype=torch.int32)
        idx = torch.arange(reqs)
        q = torch.randn(reqs, hq, d)
        out = torch.empty_like(q)

        def step(caches=caches, tables=tables, q=q, seq_lens=seq_lens, idx=idx,
                 out=out) -> None:
            for cache, table in zip(caches, tables, strict=True):
                paged_decode_attention(q, cache, table, seq_lens, idx, idx, d ** -0.5, out)

        step()
        times = []
        for _ in range(a.rounds):
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
        times.sort()
        mb = a.layers * reqs * hkv * a.context * d * 2 * cache_dtype.itemsize / 1e6
        print(f"| {reqs} | {times[0]:.3f} | {times[len(times) // 2]:.3f} | {mb:.1f} |")
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
