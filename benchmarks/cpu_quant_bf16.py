"""Quantized CPU matmuls: the float32 kernel against dequantize-to-bf16 + one bf16 GEMM
(the path `--dtype bfloat16` takes for many rows; flowengine/model/layers/quant_linear.py).

    PYTHONPATH=. python benchmarks/cpu_quant_bf16.py [--rows 16,32,64,128,512,2048] [--threads 2]

Random Q4_1 planes with SmolLM2-135M's projection shapes and a Q8_0 49152 x 576 LM head;
best of 5 calls, ms. Prints one table: shape, rows, float32 kernel ms, bf16 path ms.
"""

from __future__ import annotations

import argparse
import time

import flowengine  # noqa: F401  (before torch: the executor's thread settings)
import torch

from flowengine.model.layers.quant_linear import QuantizedWeight, quantize_q8_0

SHAPES = {"qkv": ("q4_1", 960, 576), "o": ("q4_1", 576, 576),
          "gate_up": ("q4_1", 3072, 576), "down": ("q4_1", 576, 1536),
          "lm_head": ("q8_0", 49152, 576)}


def weight(fmt: str, n: int, k: int) -> QuantizedWeight:
    if fmt == "q8_0":
        packed = quantize_q8_0(torch.randn(n, k) * 0.02)
        return QuantizedWeight("q8_0", packed.qs, packed.scales)
    qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    scales = (torch.rand(n, k // 16) * 0.01).half()  # (d, m) pairs per 32 weights
    return QuantizedWeight(fmt, qs, scales)


def best_ms(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="16,32,64,128,512,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, load {open('/proc/loadavg').read().split()[0]}")
    print("| shape | rows | float32 kernel ms | bf16 GEMM ms |\n|---|---:|---:|---:|")
    for name in args.shapes.split(","):
        fmt, n, k = SHAPES[name]
        w = weight(fmt, n, k)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            w.bf16_gemm_min_rows = None
            kernel = best_ms(lambda: w.matmul(x))
            w.bf16_gemm_min_rows = 1
            bf16 = best_ms(lambda: w.matmul(x))
            print(f"| {name} {n} x {k} | {m} | {kernel:.3f} | {bf16:.3f} |", flush=True)


if __name__ == "__main__":
    main()
