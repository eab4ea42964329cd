"""Decode attention against the copy bandwidth, on K/V bytes (issue 14, item 3).

    python benchmarks/decode_attention_bench.py --out OUT [--quick]

For each shape (batch x context x KV dtype x GQA x head_dim) one decode step of
`layers` attention calls, each over its own KV cache (so that the caches together
exceed the 50 MB L2, as a model's 32 layers do), is captured in a CUDA graph and the
replay timed with CUDA events (median of 20); time per call = replay / layers.
Bandwidth = K/V bytes read per call (every request's context, K and V) / time,
against a 4 GiB device-to-device copy measured in the same run ((read + written
bytes) / time). Variants:

- `unified`: the paged-attention kernel (the mixed prefill/decode one) on the step;
- `decode sN`: decode_attention with N splits and the default launch config;
- `decode sN tT wW pP`: with tile T, W warps, P pipeline stages (swept at the best N);
- `auto`: what the wrapper picks alone (choose_num_kv_splits + default config).

Every variant's output is checked against the float64 reference on the first
request(s) before it is timed. The markdown table comes last; JSON goes to OUT.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "kernels"))  # kernel_refs

from kernel_refs import ref_paged_attention  # noqa: E402

from flowengine.kernels.decode_attention import (  # noqa: E402
    MAX_KV_SPLITS,
    DecodeLaunchConfig,
    choose_num_kv_splits,
    decode_attention,
    default_launch_config,
)
from flowengine.kernels.paged_attention import paged_attention  # noqa: E402

FP8 = torch.float8_e4m3fn


def copy_bandwidth_gbs(gib: int = 4, iters: int = 20) -> float:
    src = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (gib << 30) / seconds / 1e9


class Shape:
    """One decode step's inputs over `layers` distinct KV caches (random contexts of
    exactly `context` tokens, blocks shuffled over the pool)."""

    def __init__(self, batch: int, context: int, kv_dtype: torch.dtype, num_kv_heads: int,
                 qpk: int, head_dim: int, block_size: int = 16, device: str = "cuda",
                 min_bytes: float = 256e6, max_layers: int = 32,
                 act_dtype: torch.dtype = torch.bfloat16) -> None:
        self.batch, self.context, self.kv_dtype = batch, context, kv_dtype
        self.num_kv_heads, self.qpk, self.head_dim = num_kv_heads, qpk, head_dim
        elem = 1 if kv_dtype == FP8 else 2
        self.kv_bytes = 2 * batch * context * num_kv_heads * head_dim * elem
        self.layers = max(2, min(max_layers, math.ceil(min_bytes / self.kv_bytes)))
        blocks_per_req = -(-context // block_size)
        num_blocks = batch * blocks_per_req + 1
        self.caches = []
        for _ in range(self.layers):
            cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim,
                                dtype=act_dtype, device=device)
            self.caches.append(cache.to(kv_dtype) if kv_dtype == FP8 else cache)
        perm = torch.randperm(num_blocks - 1, device=device).to(torch.int32) + 1
        self.block_tables = perm[: batch * blocks_per_req].view(batch, blocks_per_req)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.query = torch.randn(batch, num_kv_heads * qpk, head_dim, dtype=act_dtype,
                                 device=device)
        self.out = torch.empty_like(self.query)
        self.scale = head_dim ** -0.5

    @property
    def name(self) -> str:
        kv = "fp8" if self.kv_dtype == FP8 else str(self.kv_dtype).removeprefix("torch.")
        return (f"b{self.batch} ctx{self.context} {kv} kvh{self.num_kv_heads} "
                f"gqa{self.qpk} d{self.head_dim}")

    def check(self, fn: Callable[[torch.Tensor, torch.Tensor], None]) -> float:
        """Relative L2 error of fn's output against float64 on the first requests."""
        from kernel_refs import AttentionCase

        self.out.fill_(float("nan"))
        fn(self.caches[0], self.out)
        n = min(self.batch, 4)
        case = AttentionCase(
            query=self.query[:n], key=None, value=None, kv_cache=self.caches[0],  # type: ignore[arg-type]
            query_start_loc=self.query_start_loc[: n + 1], seq_lens=self.seq_lens[:n],
            block_tables=self.block_tables[:n], slot_mapping=None,  # type: ignore[arg-type]
            q_lens=[1] * n, ctx_lens=[self.context] * n, scale=self.scale)
        ref = ref_paged_attention(case)
        got = self.out[:n].double()
        if got.isnan().any():
            return float("nan")
        return float((got - ref).norm() / ref.norm())

    def time_us(self, fn: Callable[[torch.Tensor, torch.Tensor], None]) -> float:
        """Median per-call time (µs) of a CUDA graph of one call per layer."""
        if self.query.device.type == "cpu":  # --cpu-smoke: the interpreter, one call
            import time

            start_s = time.perf_counter()
            fn(self.caches[0], self.out)
            return (time.perf_counter() - start_s) * 1e6
        for cache in self.caches[:2]:
            fn(cache, self.out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            fn(self.caches[0], self.out)  # warm the allocator on the side stream
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for cache in self.caches:
                fn(cache, self.out)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / self.layers)
        del graph
        return sorted(times)[len(times) // 2]


def decode_fn(shape: Shape, splits: int | None, cfg: DecodeLaunchConfig | None):  # noqa: ANN201
    def fn(cache: torch.Tensor, out: torch.Tensor) -> None:
        decode_attention(shape.query, cache, shape.query_start_loc, shape.seq_lens,
                         shape.block_tables, max_seq_len=shape.context, scale=shape.scale,
                         num_kv_splits=splits, out=out, launch_config=cfg)
    return fn


def unified_fn(shape: Shape):  # noqa: ANN201
    def fn(cache: torch.Tensor, out: torch.Tensor) -> None:
        paged_attention(shape.query, cache, shape.query_start_loc, shape.seq_lens,
                        shape.block_tables, max_query_len=1, scale=shape.scale, out=out)
    return fn


def run_shape(shape: Shape, bw: float, full: bool) -> list[dict]:
    rows: list[dict] = []

    def add(variant: str, fn: Callable, **extra: object) -> float:
        err = shape.check(fn)
        us = shape.time_us(fn)
        gbs = shape.kv_bytes / (us * 1e-6) / 1e9
        rows.append({"shape": shape.name, "variant": variant, "us": us, "gbs": gbs,
                     "frac_copy_bw": gbs / bw, "rel_err": err, "layers": shape.layers,
                     **extra})
        print(f"{shape.name:38s} {variant:24s} {us:9.2f} us {gbs:7.0f} GB/s "
              f"{100 * gbs / bw:5.1f}%  err {err:.1e}", flush=True)
        return us

    add("unified", unified_fn(shape))
    auto_splits = choose_num_kv_splits(shape.batch, shape.num_kv_heads, shape.context,
                                       torch.device("cuda"))
    add(f"auto (s{auto_splits})", decode_fn(shape, None, None), splits=auto_splits)
    split_choices = [s for s in (1, 2, 4, 8, 16, 32, 64) if s <= MAX_KV_SPLITS
                     and (s == 1 or shape.context // s >= 16)]
    if not full:
        split_choices = sorted({1, auto_splits, min(MAX_KV_SPLITS, auto_splits * 2),
                                max(1, auto_splits // 2)})
    best_split, best_us = 1, float("inf")
    for s in split_choices:
        us = add(f"decode s{s}", decode_fn(shape, s, None), splits=s)
        if us < best_us:
            best_split, best_us = s, us
    default = default_launch_config(shape.head_dim, shape.kv_dtype)
    configs = [DecodeLaunchConfig(tile, warps, stages) for tile in (32, 64)
               for warps in (4, 8) for stages in (1, 2, 3)]
    configs += [DecodeLaunchConfig(16, 4, 2), DecodeLaunchConfig(16, 2, 2)]
    for cfg in configs if full else ():
        if cfg == default:
            continue
        add(f"decode s{best_split} t{cfg.tile_n} w{cfg.num_warps} p{cfg.num_stages}",
            decode_fn(shape, best_split, cfg), splits=best_split, tile_n=cfg.tile_n,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return rows


def fused_rows(device: torch.device, smoke: bool = False) -> list[dict]:
    """rotary_embedding + reshape_and_cache against rotary_embedding_and_cache at
    Llama-3.1-8B shapes (32 / 8 heads, head_dim 128), 32 layers in one graph; the
    outputs (rotated q, cache bytes) must be equal bit for bit."""
    from flowengine.kernels.reshape_and_cache import reshape_and_cache
    from flowengine.kernels.rope_cache import build_rope_cache
    from flowengine.kernels.rotary import rotary_embedding, rotary_embedding_and_cache

    rows = []
    layers = 2 if smoke else 32
    for tokens in ((1, 3) if smoke else (1, 256)):
        for kv in (torch.bfloat16, FP8):
            cos, sin = build_rope_cache(128, 4096, 500000.0, device=device)
            qkv = torch.randn(tokens, 48 * 128, dtype=torch.bfloat16, device=device)
            q = qkv[:, :4096].view(tokens, 32, 128)
            k = qkv[:, 4096:5120].view(tokens, 8, 128)
            v = qkv[:, 5120:].view(tokens, 8, 128)
            positions = torch.randint(0, 4096, (tokens,), device=device)
            caches = [torch.zeros(2, tokens + 1, 16, 8, 128, device=device).to(kv)
                      for _ in range(layers)]
            slots = torch.randperm(16 * (tokens + 1), device=device)[:tokens]

            def separate(cache: torch.Tensor) -> None:
                rotary_embedding(positions, q, k, cos, sin)  # noqa: B023 (used in-loop)
                reshape_and_cache(k, v, cache, slots)  # noqa: B023

            def fused(cache: torch.Tensor) -> None:
                rotary_embedding_and_cache(positions, q, k, v, cache, slots,  # noqa: B023
                                           cos, sin)  # noqa: B023

            q0, k0 = q.clone(), k.clone()
            separate(caches[0])
            want_q, want_cache = q.clone(), caches[0].clone()
            q.copy_(q0)
            k.copy_(k0)
            fused(caches[1])
            assert torch.equal(q, want_q)
            assert torch.equal(caches[1].view(torch.uint8), want_cache.view(torch.uint8))
            if smoke:
                continue
            for name, fn in (("rotary + reshape_and_cache", separate),
                             ("rotary_embedding_and_cache", fused)):
                graph = torch.cuda.CUDAGraph()
                fn(caches[0])
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    for cache in caches:
                        fn(cache)
                graph.replay()
                times = []
                for _ in range(20):
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    graph.replay()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) * 1e3 / layers)
                us = sorted(times)[10]
                kvn = "fp8" if kv == FP8 else "bf16"
                rows.append({"tokens": tokens, "kv": kvn, "variant": name, "us": us})
                print(f"fused: T={tokens} {kvn} {name}: {us:.2f} us per layer", flush=True)
    return rows


def fp8_qk_rows(ns: argparse.Namespace, bw: float) -> int:
    """--fp8-qk: E4M3 cache, Llama-3.1-8B heads, batch 1 to 512: the default config
    (K and V widened to fp16) against fp8_qk=True at the same split count and tiles,
    and two larger fp8_qk tiles; each checked against float64 before it is timed."""
    rows: list[dict] = []
    for batch in (1, 64, 256, 512):
        shape = Shape(batch, ns.context, FP8, 8, 4, 128)
        splits = choose_num_kv_splits(batch, 8, ns.context, torch.device("cuda"))
        base = default_launch_config(128, FP8)
        variants = [("widen (default)", DecodeLaunchConfig(base.tile_n, base.num_warps,
                                                           base.num_stages, fp8_qk=False)),
                    ("fp8_qk", DecodeLaunchConfig(base.tile_n, base.num_warps,
                                                  base.num_stages, fp8_qk=True)),
                    ("fp8_qk t32 w4", DecodeLaunchConfig(32, 4, 2, fp8_qk=True)),
                    ("fp8_qk t64 w4", DecodeLaunchConfig(64, 4, 2, fp8_qk=True))]
        for name, cfg in variants:
            err = shape.check(decode_fn(shape, splits, cfg))
            us = shape.time_us(decode_fn(shape, splits, cfg))
            gbs = shape.kv_bytes / (us * 1e-6) / 1e9
            rows.append({"shape": shape.name, "variant": f"s{splits} {name}", "us": us,
                         "gbs": gbs, "frac_copy_bw": gbs / bw, "rel_err": err})
            print(f"{shape.name:38s} s{splits} {name:18s} {us:9.2f} us {gbs:7.0f} GB/s "
                  f"{100 * gbs / bw:5.1f}%  err {err:.1e}", flush=True)
        del shape
        torch.cuda.empty_cache()
    os.makedirs(ns.out, exist_ok=True)
    with open(os.path.join(ns.out, "decode_attention_fp8_qk.json"), "w", encoding="utf-8") as f:
        json.dump({"copy_bandwidth_gbs": bw, "rows": rows}, f, indent=1)
    print(f"\n{' '.join([sys.executable, *sys.argv])}\n{torch.cuda.get_device_name()}, "
          f"copy bandwidth {bw:.0f} GB/s\n\n| shape | variant | µs / layer | % copy bw | rel err |"
          "\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['variant']} | {r['us']:.2f} | {100 * r['frac_copy_bw']:.1f}% "
              f"| {r['rel_err']:.1e} |")
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true", help="no tile/warp/stage sweep")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--fp8-qk", action="store_true",
                   help="only Llama-3.1-8B shapes over an E4M3 cache: the default widening "
                        "kernel against Q.K in E4M3 (DecodeLaunchConfig.fp8_qk)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on the CPU under TRITON_INTERPRET=1 (checks, no timing)")
    ns = p.parse_args(argv)
    torch.manual_seed(0)
    if ns.cpu_smoke:
        # fp16, not bf16: the interpreter's bf16 tl.dot is wrong (tests/kernels say so).
        for batch, kv in ((1, torch.float16), (3, FP8)):
            shape = Shape(batch, 96, kv, 2, 4, 64, device="cpu", min_bytes=0, max_layers=2,
                          act_dtype=torch.float16)
            for fn in (unified_fn(shape), decode_fn(shape, None, None),
                       decode_fn(shape, 1, DecodeLaunchConfig(16, 2, 1)),
                       decode_fn(shape, 4, DecodeLaunchConfig(64, 8, 3))):
                err = shape.check(fn)
                print(shape.name, f"rel err {err:.1e}")
                assert err < 2e-2, err
        fused_rows(torch.device("cpu"), smoke=True)
        return 0
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    bw = copy_bandwidth_gbs()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    # Llama-3.1-8B (8 KV heads, GQA 4, head_dim 128) from batch 1 to 512, both caches;
    # then GQA 1 / 8 and head_dim 64 at batch 1 and 256.
    bf16 = torch.bfloat16
    specs = [(b, kv, 8, 4, 128) for b in (1, 256) for kv in (bf16, FP8)]
    specs += [(b, kv, 8, 4, 128) for b in (16, 64, 512) for kv in (bf16, FP8)]
    specs += [(b, bf16, 8, 1, 128) for b in (1, 256)]
    specs += [(b, bf16, 4, 8, 128) for b in (1, 256)]
    specs += [(b, kv, 8, 4, 64) for b in (1, 256) for kv in (bf16, FP8)]
    rows: list[dict] = []
    if ns.fp8_qk:
        return fp8_qk_rows(ns, bw)
    for batch, kv, kvh, qpk, hd in specs:
        shape = Shape(batch, ns.context, kv, kvh, qpk, hd)
        full = not ns.quick and batch in (1, 256) and (qpk, hd) == (4, 128)
        rows += run_shape(shape, bw, full)
        del shape
        torch.cuda.empty_cache()
    os.makedirs(ns.out, exist_ok=True)
    meta = {"command": " ".join([sys.executable, *sys.argv]),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "copy_bandwidth_gbs": bw}
    fused = fused_rows(torch.device("cuda"))
    with open(os.path.join(ns.out, "decode_attention_bench.json"), "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "rows": rows, "fused": fused}, f, indent=1)
    print(f"\n{meta['command']}\n{meta['date']} {meta['gpu']} torch {meta['torch']}, "
          f"copy bandwidth {bw:.0f} GB/s\n")
    print("| shape | unified µs | auto µs (% copy bw) | best variant | best µs (% copy bw) |")
    print("|---|---|---|---|---|")
    for name in dict.fromkeys(r["shape"] for r in rows):
        group = [r for r in rows if r["shape"] == name]
        uni = next(r for r in group if r["variant"] == "unified")
        auto = next(r for r in group if r["variant"].startswith("auto"))
        best = min(group, key=lambda r: r["us"])
        print(f"| {name} | {uni['us']:.2f} ({100 * uni['frac_copy_bw']:.0f}%) | "
              f"{auto['us']:.2f} ({100 * auto['frac_copy_bw']:.0f}%) {auto['variant']} | "
              f"{best['variant']} | {best['us']:.2f} ({100 * best['frac_copy_bw']:.0f}%) |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
