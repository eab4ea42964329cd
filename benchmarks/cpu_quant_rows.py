"""Quantized CPU matmul by activation rows: the C kernel (`_cpu_ops.linear`) against
dequantize + torch's GEMM (the path above DEQUANT_MIN_ROWS), for the default model's
weight shapes (SmolLM2-135M: gate_up, down, qkv, the tied Q8_0 LM head). Random packed
weights (the kernels' time does not depend on the values); best of a few calls per
figure, the two paths alternated per shape and row count, all rounds in one process.

    PYTHONPATH=. python benchmarks/cpu_quant_rows.py --rows 16,32,64,128,512 --threads 1,2
    (--shapes q4_1:3072x576,q4_1:576x1536 to restrict; FLOWENGINE_CPU_ROW_TILE_KB=N
    overrides the float32 body's 40 KB activation tile: 0 = tiles of 8 rows, 1000000 =
    no tiling, the body before session 27's fix; --dtype bfloat16 makes the second path
    dequantize to bf16 for one bf16 GEMM, the path `--dtype bfloat16` takes from
    BF16_GEMM_MIN_ROWS rows, and adds the kernel's AMX bodies where the CPU has them:
    AMX-BF16 and, up to _cpu_ops.AMX_INT8_MAX_ROWS rows, AMX-INT8; `--dtype bfloat16`
    takes the latter from AMX_ROWS[format][0] rows, the former above)

Prints a markdown table: ms per call of each path and the dequantizing path's ratio
to the kernel.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from flowengine import _cpu_ops as ops
from flowengine.model.layers.quant_linear import FORMATS, QuantizedWeight

DEFAULT_SHAPES = "q4_1:3072x576,q4_1:576x1536,q4_1:960x576,q8_0:49152x576"


def packed(fmt: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    nb = k // 32
    if fmt == "q8_0":
        return (torch.randint(-127, 127, (n, k), dtype=torch.int8),
                (torch.rand(n, nb) * 0.01).half())
    return (torch.randint(0, 255, (n, k // 2), dtype=torch.uint8),
            (torch.rand(n, nb * FORMATS[fmt][2]) * 0.01).half())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,32,64,128,256,512")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the dequantizing path's GEMM dtype")
    a = ap.parse_args()
    gemm_dtype = getattr(torch, a.dtype)
    rows = [int(r) for r in a.rows.split(",")]
    threads = [int(t) for t in a.threads.split(",")]
    shapes = []
    for s in a.shapes.split(","):
        fmt, nk = s.split(":")
        n, k = nk.split("x")
        shapes.append((fmt, int(n), int(k)))
    paths = ["kernel", "dequant"]
    if a.dtype == "bfloat16" and ops.has_amx():
        paths.append("amx")
    int8 = "amx" in paths and ops.has_amx_int8()
    if int8:
        paths.append("amx_int8")
    best: dict[tuple, float] = {}
    for _ in range(a.rounds):
        for fmt, n, k in shapes:
            qs, sc = packed(fmt, n, k)
            w = QuantizedWeight(fmt, qs, sc)
            for m in rows:
                x = torch.randn(m, k)
                x_gemm = x.to(gemm_dtype)
                out = torch.empty(m, n)
                for th in threads:
                    torch.set_num_threads(th)
                    calls = 2 if n * m > 49152 * 32 else 6
                    for path in paths:
                        if path == "amx_int8" and m > ops.AMX_INT8_MAX_ROWS:
                            continue
                        for _ in range(calls):
                            t0 = time.perf_counter()
                            if path != "dequant":
                                ops.linear(FORMATS[fmt][0], x.data_ptr(), m, k, qs.data_ptr(),
                                           sc.data_ptr(), n, out.data_ptr(), th,
                                           0 if path == "kernel" else 1, path == "amx")
                            else:
                                F.linear(x_gemm, w.dequantize(gemm_dtype))
                            dt = time.perf_counter() - t0
                            key = (fmt, n, k, m, th, path)
                            best[key] = min(best.get(key, 1e9), dt)
    amx = "amx" in paths
    print(f"| weight | rows | threads | kernel ms | dequant + {a.dtype} GEMM ms | ratio |"
          + (" AMX-BF16 body ms |" if amx else "") + (" AMX-INT8 body ms |" if int8 else ""))
    print("|---|---|---|---|---|---|" + ("---|" if amx else "") + ("---|" if int8 else ""))
    for fmt, n, k in shapes:
        for m in rows:
            for th in threads:
                kt, dt = best[(fmt, n, k, m, th, "kernel")], best[(fmt, n, k, m, th, "dequant")]
                print(f"| {fmt} {n}x{k} | {m} | {th} | {kt * 1e3:.2f} | {dt * 1e3:.2f} | "
                      f"{dt / kt:.2f} |"
                      + (f" {best[(fmt, n, k, m, th, 'amx')] * 1e3:.2f} |" if amx else "")
                      + ((f" {best[(fmt, n, k, m, th, 'amx_int8')] * 1e3:.3f} |"
                          if (fmt, n, k, m, th, "amx_int8") in best else " - |") if int8 else ""))


if __name__ == "__main__":
    main()
