"""Decode GEMVs (kernels/gemv.py) on the GPU at Llama-3.1-8B shapes, timed INSIDE CUDA
graphs (issue 14 (a), issue 15 W4A16 batch 1).

    python benchmarks/gemv_gpu.py --out /tmp/gemv [--budget-s 280]

For each format (bf16 dense, FP8 E4M3 per-channel, W4A16 GPTQ group 128 without and
with act-order), shape (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down
4096x14336, LM head 128256x4096, N x K; `--shapes qwen3moe` adds Qwen3-30B-A3B's qkv,
o and LM head) and M in {1, 8}: a sweep of GEMV tile
configs against the current path (bf16 F.linear / cuBLAS, fp8_w8a16_gemm,
w4a16_gemm). Every variant is captured in one CUDA graph of calls over rotating weight
copies (>= 256 MB in all, more than the L2), replayed; time per call = median replay /
calls. Bytes = weights (+ scales / zeros) read once; % = GB/s over the device-to-device
copy bandwidth measured in the same run. Writes kernels/configs-style JSON
(gemv,device_name=*.json) to --out: per (format, M, N, K) the best config and whether it
beat the current path. The table comes last. The file holds only the formats and
shapes of this run: merge it into kernels/configs/ by hand when adding to a committed
table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_bench import copy_bandwidth_gbs  # noqa: E402

from flowengine.kernels.fp8_linear import fp8_w8a16_gemm  # noqa: E402
from flowengine.kernels.gemv import dense_gemv, w4a16_gemv  # noqa: E402
from flowengine.kernels.w4a16 import w4a16_gemm  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
# Qwen3-30B-A3B's dense projections (--shapes qwen3moe; its experts run fused_moe).
QWEN3_MOE_SHAPES = {"q3_qkv": (5120, 2048), "q3_o": (2048, 4096),
                    "q3_lm_head": (151936, 2048)}
SMS = 132
# (BLOCK_N, BLOCK_K, num_warps, num_stages); split from programs-per-SM targets
DENSE_M1 = [(16, 256, 4, 3), (16, 512, 4, 3), (32, 256, 8, 3), (8, 512, 4, 3),
            (64, 128, 4, 3), (32, 512, 8, 2)]
DENSE_M8 = [(16, 128, 4, 3), (32, 64, 4, 3), (16, 256, 8, 3)]
W4_M1 = [(64, 128, 4, 3), (32, 128, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3),
         (64, 64, 4, 4), (256, 128, 4, 3), (256, 128, 8, 3)]
W4_M8 = [(64, 128, 4, 3), (32, 128, 4, 3), (128, 64, 8, 3)]
PROGRAMS_PER_SM = (2, 6)
# W4A16 at M = 1 wins with more programs (session 41, H100: split 16 at gate_up)
W4_M1_PROGRAMS_PER_SM = (2, 4, 8)


def _split(n: int, k: int, block_n: int, block_k: int, per_sm: int) -> int:
    tiles = -(-n // block_n)
    split = 1
    while tiles * split < per_sm * SMS and k // (split * 2) >= 2 * block_k:
        split *= 2
    return split


def graph_time_us(make_call, copies: int, reps: int = 20) -> float:
    """Median replay time / calls of a graph of `copies` calls (one per weight copy),
    repeated so the graph holds >= 24 calls."""
    per = max(1, -(-24 // copies))
    for c in range(copies):  # warm up / compile outside the capture
        make_call(c)()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        calls = [make_call(c) for c in range(copies)]
        with torch.cuda.graph(g, stream=stream):
            for _ in range(per):
                for fn in calls:
                    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps + 3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    del g
    times = sorted(times[3:])
    return times[len(times) // 2] * 1e3 / (per * copies)


def _weights(fmt: str, n: int, k: int, copies: int):
    dev = "cuda"
    out = []
    for _ in range(copies):
        if fmt == "bf16":
            out.append((torch.randn(n, k, device=dev, dtype=torch.bfloat16),))
        elif fmt == "fp8":
            w = (torch.randn(n, k, device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
            out.append((w, torch.rand(n, device=dev) * 0.01 + 1e-3))
        else:
            g = k // 128
            qw = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev)
            sc = (torch.rand(g, n, device=dev) * 0.02 + 0.005).to(torch.bfloat16)
            qz = torch.randint(0, 16, (g, n), dtype=torch.uint8, device=dev)
            gi = None
            if fmt == "w4a16_act":
                gi = (torch.arange(k, device=dev, dtype=torch.int32) // 128)[
                    torch.randperm(k, device=dev)].contiguous()
            out.append((qw, sc, qz, gi))
    return out


def _bytes(fmt: str, n: int, k: int) -> int:
    if fmt == "bf16":
        return 2 * n * k
    if fmt == "fp8":
        return n * k + 4 * n
    return n * k // 2 + 3 * n * (k // 128) + (4 * k if fmt == "w4a16_act" else 0)


def _check(fmt, x, w, out) -> float:
    """Relative error of the GEMV against the float32 reference (full shapes)."""
    if fmt == "bf16":
        ref = x.float() @ w[0].float().t()
    elif fmt == "fp8":
        ref = x.float() @ (w[0].float() * w[1][:, None]).t()
    else:
        from flowengine.kernels.w4a16 import w4a16_reference
        ref = w4a16_reference(x, w[0], w[1], w[2], w[3], 128)
    return ((out.float() - ref).norm() / ref.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/gemv")
    ap.add_argument("--budget-s", type=float, default=280.0)
    ap.add_argument("--formats", default="bf16,fp8,w4a16,w4a16_act")
    ap.add_argument("--shapes", default="llama8b",
                    help="comma list of llama8b (Llama-3.1-8B) and qwen3moe (Qwen3-30B-A3B's "
                         "attention and LM head)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    copy_gbs = copy_bandwidth_gbs(gib=2)
    print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    table, rows = {}, []
    fmts = args.formats.split(",")
    shapes = {}
    for group in args.shapes.split(","):
        shapes.update({"llama8b": SHAPES, "qwen3moe": QWEN3_MOE_SHAPES}[group])
    order = [(1, f) for f in fmts if f != "w4a16_act"] + [
        (8, f) for f in fmts if f != "w4a16_act"] + [(1, f) for f in fmts if f == "w4a16_act"]
    for m, fmt in order:
        if True:
            for name, (n, k) in shapes.items():
                if time.time() - t0 > args.budget_s:
                    print(f"budget spent, skipping {fmt} M={m} {name}", flush=True)
                    continue
                nbytes = _bytes(fmt, n, k)
                copies = max(1, min(16, -(-(256 << 20) // nbytes)))
                ws = _weights(fmt, n, k, copies)
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

                def base(c, ws=ws, x=x, fmt=fmt):
                    w = ws[c]
                    if fmt == "bf16":
                        return lambda: F.linear(x, w[0])
                    if fmt == "fp8":
                        return lambda: fp8_w8a16_gemm(x, w[0], w[1])
                    return lambda: w4a16_gemm(x, w[0], w[1], w[2], w[3], 128)

                base_us = graph_time_us(base, copies)
                w4 = fmt.startswith("w4a16")
                variants = (W4_M1 if m == 1 else W4_M8) if w4 else (
                    DENSE_M1 if m == 1 else DENSE_M8)
                seen, results = set(), []
                for bn, bk, warps, stages in variants:
                    for per_sm in (W4_M1_PROGRAMS_PER_SM if w4 and m == 1 else
                                   PROGRAMS_PER_SM):
                        cfg = (bn, bk, _split(n, k, bn, bk, per_sm), warps, stages)
                        if cfg in seen:
                            continue
                        seen.add(cfg)

                        def call(c, ws=ws, x=x, cfg=cfg, w4=w4, fmt=fmt):
                            w = ws[c]
                            if w4:
                                return lambda: w4a16_gemv(x, w[0], w[1], w[2], w[3], 128,
                                                          config=cfg)
                            return lambda: dense_gemv(x, w[0], None,
                                                      w[1] if fmt == "fp8" else None,
                                                      config=cfg)
                        try:
                            us = graph_time_us(call, copies)
                        except Exception as exc:  # a config that does not compile
                            print(f"  {fmt} {name} M={m} {cfg}: {type(exc).__name__}",
                                  flush=True)
                            continue
                        results.append((us, cfg))
                if not results:
                    continue
                results.sort()
                best_us, best = results[0]
                w = ws[0]
                out = (w4a16_gemv(x, w[0], w[1], w[2], w[3], 128, config=best) if w4 else
                       dense_gemv(x, w[0], None, w[1] if fmt == "fp8" else None, config=best))
                rel = _check(fmt, x, w, out)
                gbs = nbytes / best_us / 1e3
                key_fmt = {"bf16": "dense", "w4a16_act": "w4a16_act"}.get(fmt, fmt)
                table[f"{key_fmt},{m},{n},{k}"] = {
                    "block_n": best[0], "block_k": best[1], "split_k": best[2],
                    "num_warps": best[3], "num_stages": best[4],
                    "faster": best_us < base_us and rel < 1e-2,
                    "gemv_us": round(best_us, 2), "current_us": round(base_us, 2),
                    "pct_copy": round(100 * gbs / copy_gbs, 1), "rel_err": rel}
                rows.append((fmt, m, name, base_us, best_us, 100 * nbytes / base_us / 1e3
                             / copy_gbs, 100 * gbs / copy_gbs, best, rel))
                print(f"{fmt:9s} M={m} {name:8s} current {base_us:8.2f} us  gemv "
                      f"{best_us:8.2f} us ({100 * gbs / copy_gbs:5.1f}% copy) {best} "
                      f"rel {rel:.1e}  all: {[(round(u, 1), c) for u, c in results]}",
                      flush=True)
                del ws
                torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name().replace(" ", "_")
    with open(os.path.join(args.out, f"gemv,device_name={dev}.json"), "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    print(f"\n{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
          f"{torch.cuda.get_device_name()}, copy {copy_gbs:.0f} GB/s, CUDA-graph timed")
    print(f"{'format':9s} {'M':>2s} {'shape':8s} {'current us':>10s} {'%copy':>6s} "
          f"{'gemv us':>8s} {'%copy':>6s}  config (BN,BK,split,warps,stages)  rel err")
    for fmt, m, name, b, g, bp, gp, cfg, rel in rows:
        print(f"{fmt:9s} {m:2d} {name:8s} {b:10.2f} {bp:6.1f} {g:8.2f} {gp:6.1f}  {cfg} "
              f"{rel:.1e}")


if __name__ == "__main__":
    main()
