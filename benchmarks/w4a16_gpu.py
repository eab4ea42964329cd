"""W4A16 on the H200 at Llama-3.1-8B shapes (issue 15, item 5): 4-bit GPTQ layout with
dummy packed weights (group size 128, no act-order), bf16 beside it.

    python benchmarks/w4a16_gpu.py --out /tmp/w4a16

a. each projection's GEMM at M = 1 (qkv, o, gate_up, down), W4A16 at the heuristic
   launch parameters and a small sweep, and bf16 F.linear; time per call over 8
   rotating weight copies (more than the 50 MB L2), CUDA events, median of 50;
   roofline = packed bytes (qweight + qzeros + scales) / copy bandwidth.
b. batch-1 decode of the whole model (32 layers, bf16 LM head, 1k context) through the
   engine's CUDA-graph step (gpu_bench.device_step_ms), 4-bit and bf16, each against
   the roofline of the bytes it must read (4-bit: packed projections + bf16 LM head,
   norms, one embedding row, KV of 1k tokens).
The table comes last; JSON in --out. --skip-gemm runs (b) only, --skip-model (a) only.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shlex
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_bench import LLAMA_31_8B, copy_bandwidth_gbs, device_step_ms  # noqa: E402

from flowengine.config import EngineArgs  # noqa: E402
from flowengine.engine.builder import build_engine_core, resolve  # noqa: E402
from flowengine.kernels.w4a16 import _config, w4a16_gemm  # noqa: E402
from flowengine.model.layers.int4 import Int4Linear  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096)}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
        "sym": True, "checkpoint_format": "gptq"}
# (BLOCK_N, BLOCK_K, split factor over the one that gives >= 4 programs per SM)
SWEEP = [(32, 128, 1), (64, 128, 1), (128, 128, 1), (64, 256, 1), (128, 256, 1),
         (64, 128, 2), (128, 128, 2), (64, 128, 0.5)]
COPIES = 8


def _time_ms(fn, iters: int = 50) -> float:
    times = []
    for i in range(iters + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def gemm_table(bw_gbs: float) -> list[dict]:
    rows = []
    dev = torch.device("cuda")
    for name, (k, n) in SHAPES.items():
        g = k // 128
        layers = [(torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev),
                   (torch.rand(g, n, device=dev) * 1e-3 + 1e-4).half(),
                   torch.randint(0, 16, (g, n), dtype=torch.uint8, device=dev))
                  for _ in range(COPIES)]
        dense = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.01
                 for _ in range(COPIES)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        packed = k * n // 2 + 2 * g * n + g * n  # qweight + fp16 scales + uint8 zeros
        roof_ms = packed / bw_gbs / 1e6
        heuristic = _config(1, n, k, 128, dev)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        best = None
        configs = [heuristic]
        for bn, bk, factor in SWEEP:
            split = 1
            while -(-n // bn) * split < 4 * sms and k // (split * 2) >= bk:
                split *= 2
            configs.append((16, bn, bk, max(1, int(split * factor))))
        for cfg in configs:
            def run(cfg=cfg, layers=layers, x=x) -> None:
                for qw, s, z in layers:
                    w4a16_gemm(x, qw, s, z, None, 128, config=cfg)
            try:
                ms = _time_ms(run) / COPIES
            except Exception as err:  # noqa: BLE001 - a config the GPU cannot run
                print(f"{name} {cfg}: {type(err).__name__} {str(err)[:120]}", flush=True)
                continue
            rows.append({"shape": name, "K": k, "N": n, "config": list(cfg), "ms": ms,
                         "roofline_ms": roof_ms, "heuristic": cfg == heuristic})
            if best is None or ms < best[1]:
                best = (cfg, ms)
        bf16_ms = _time_ms(lambda x=x, dense=dense: [F.linear(x, w) for w in dense]) / COPIES
        rows.append({"shape": name, "K": k, "N": n, "config": "bf16", "ms": bf16_ms,
                     "roofline_ms": 2 * k * n / bw_gbs / 1e6, "heuristic": False})
        print(f"{name}: heuristic {heuristic} best {best}", flush=True)
        del layers, dense
        torch.cuda.empty_cache()
    return rows


def model_bytes(runner, context: int) -> float:
    """Bytes one batch-1 decode step reads: packed Int4Linear buffers, every float
    parameter except the untied embedding table (one row of it), KV of `context`."""
    model = runner.model
    total = 0
    for m in model.modules():
        if isinstance(m, Int4Linear):
            total += m.packed_bytes()
    for name, p in model.named_parameters():
        if name == "model.embed_tokens.weight" and model.lm_head is not None:
            total += p[0].numel() * p.element_size()
        else:
            total += p.numel() * p.element_size()
    kv = runner.kv_cache_bytes_per_block(runner.model_config, 1, runner.kv_cache_dtype)
    return total + context * kv


def decode(model_dir: str, context: int, bw_gbs: float) -> dict:
    args = EngineArgs(model=model_dir, load_format="dummy", dtype="bfloat16", device="cuda",
                      max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=2048,
                      gpu_memory_utilization=0.5)
    engine = build_engine_core(resolve(args))
    runner = engine.executor.runner
    ms = device_step_ms(runner, 1, context)
    nbytes = model_bytes(runner, context)
    out = {"ms": ms, "bytes": nbytes, "roofline_ms": nbytes / bw_gbs / 1e6}
    if hasattr(engine, "shutdown"):
        engine.shutdown()
    del engine, runner
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--skip-gemm", action="store_true", help="only the batch-1 decode (b)")
    ns = p.parse_args(argv)
    bw = copy_bandwidth_gbs()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    rows = [] if ns.skip_gemm else gemm_table(bw)
    results: dict = {"gemm": rows}
    if not ns.skip_model:
        for label, extra in (("4-bit GPTQ", {"quantization_config": GPTQ}), ("bf16", {})):
            d = tempfile.mkdtemp(prefix="llama31-8b-")
            with open(os.path.join(d, "config.json"), "w", encoding="utf-8") as f:
                json.dump({**LLAMA_31_8B, **extra}, f)
            results[label] = decode(d, ns.context, bw)
            print(label, results[label], flush=True)
    meta = {"command": shlex.join([sys.executable, *sys.argv]),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "copy_bandwidth_gbs": bw}
    os.makedirs(ns.out, exist_ok=True)
    with open(os.path.join(ns.out, "w4a16_gpu.json"), "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(f"\n{meta['gpu']}, torch {meta['torch']}, {meta['date']}, copy {bw:.0f} GB/s")
    print(f"command: {meta['command']}\n")
    print("| GEMM M=1 (K x N) | config (BM,BN,BK,split) | ms | roofline ms | x roofline |")
    print("|---|---|---|---|---|")
    for r in rows:
        tag = " (default)" if r["heuristic"] else ""
        print(f"| {r['shape']} {r['K']}x{r['N']} | {r['config']}{tag} | {r['ms']:.4f} | "
              f"{r['roofline_ms']:.4f} | {r['ms'] / r['roofline_ms']:.2f} |")
    for label in ("4-bit GPTQ", "bf16"):
        if label in results:
            r = results[label]
            print(f"| decode batch 1, {ns.context} ctx, {label} | {r['bytes'] / 1e9:.2f} GB | "
                  f"{r['ms']:.3f} ms | {r['roofline_ms']:.3f} ms | "
                  f"{r['ms'] / r['roofline_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
