"""All the quantized matmuls of one CPU decode step of the default model, by body and
activation rows (issue #20).

    python benchmarks/cpu_matmul_step.py                       # rows 1,2,3,4,8,16
    python benchmarks/cpu_matmul_step.py --rows 9,16 --bodies bf16 --rounds 7

One "step" is what the model's forward multiplies: 30 layers of qkv (960 x 576), o
(576 x 576), gate_up (3072 x 576) and down (576 x 1536) in Q4_1, then the tied Q8_0 LM
head (49152 x 576), every layer with its own random packed weights (96 MB together),
so the weights come from L3 or memory as in the model and not from L2 as in
benchmarks/cpu_quant_rows.py's per-matmul figures. Norms, attention and sampling are
not in it: the difference to benchmarks/cpu_decode_rows.py's whole step is theirs.

Bodies (`_cpu_ops.linear`'s choice forced per call): `float32` the float32 kernels
(VNNI up to 3 rows where the CPU has it, else the register and panel bodies), `int16`
the AVX2 int16 panel body (CPUs without AVX-512, from its row count up), `i8` the
AMX-INT8 body (up to _cpu_ops.AMX_INT8_MAX_ROWS rows), `bf16` the AMX-BF16 body; a body
the CPU lacks, or rows the AMX-INT8 body does not take, are skipped. Prints the median
ms per step over --rounds, bodies and row counts alternated within each round, with the
load average before and after.

`--pages 4k,huge` also alternates where the weights live: `4k` torch's own allocations
(4 KiB pages, the default), `huge` one arena advised for transparent huge pages
(flowengine/executor/cpu_hugepages.py, where the engine puts a CPU model's weights with
FLOWENGINE_CPU_HUGEPAGES=1):

    python benchmarks/cpu_matmul_step.py --rows 1,16 --bodies int16 --pages 4k,huge --rounds 21
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from cpu_quant_rows import packed  # this folder is sys.path[0] when run as a script

from flowengine import _cpu_ops as ops
from flowengine.executor import cpu_hugepages
from flowengine.model.layers.quant_linear import FORMATS

LAYERS = 30
LAYER_SHAPES = [("q4_1", 960, 576), ("q4_1", 576, 576), ("q4_1", 3072, 576),
                ("q4_1", 576, 1536)]
HEAD = ("q8_0", 49152, 576)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,3,4,8,16")
    p.add_argument("--bodies", default="float32,int16,i8,bf16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--pages", default="4k", help="4k and/or huge, comma-separated")
    a = p.parse_args()
    pages = a.pages.split(",")
    rows = [int(r) for r in a.rows.split(",")]
    bodies = a.bodies.split(",")
    available = {"float32": True, "int16": "int16" in ops.linear_path(1 << 20),
                 "i8": ops.has_amx_int8(), "bf16": ops.has_amx()}
    weights = {"4k": [[packed(*s) for s in LAYER_SHAPES] for _ in range(LAYERS)]}
    head = {"4k": packed(*HEAD)}
    if "huge" in pages:  # the same bytes, copied into one huge-page arena
        tensors = [t for layer in weights["4k"] for w in layer for t in w] + list(head["4k"])
        arena = cpu_hugepages.HugePageArena(sum(cpu_hugepages.padded_bytes(t.nbytes)
                                                  for t in tensors))

        def moved(t: torch.Tensor) -> torch.Tensor:
            v = arena.take(t.nbytes).view(t.dtype).view(t.shape)
            return v.copy_(t)

        weights["huge"] = [[tuple(moved(t) for t in w) for w in layer]
                           for layer in weights["4k"]]
        head["huge"] = tuple(moved(t) for t in head["4k"])
    xs = {(m, k): torch.randn(m, k) for m in rows for k in (576, 1536)}
    outs = {(m, n): torch.empty(m, n) for m in rows for n in (960, 576, 3072, 49152)}

    def mm(shape, w, m, amx_min, no_int8):
        fmt, n, k = shape
        ops.linear(FORMATS[fmt][0], xs[(m, k)].data_ptr(), m, k, w[0].data_ptr(),
                   w[1].data_ptr(), n, outs[(m, n)].data_ptr(), a.threads, amx_min, no_int8)

    def step(m: int, body: str, page: str) -> float:
        amx_min, no_int8 = {"float32": (0, True), "int16": (0, False), "i8": (1, False),
                            "bf16": (1, True)}[body]
        t0 = time.perf_counter()
        for layer in weights[page]:
            for shape, w in zip(LAYER_SHAPES, layer, strict=True):
                mm(shape, w, m, amx_min, no_int8)
        mm(HEAD, head[page], m, amx_min, no_int8)
        return (time.perf_counter() - t0) * 1e3

    runs = [(m, b, pg) for m in rows for b in bodies for pg in pages if available.get(b)
            and not (b == "i8" and m > ops.AMX_INT8_MAX_ROWS)
            and not (b == "int16" and "int16" not in ops.linear_path(m))]
    print("load before", open("/proc/loadavg").read().split()[:3])
    res: dict[tuple[int, str, str], list[float]] = {r: [] for r in runs}
    for r in runs:  # warm-up
        step(*r)
    for _ in range(a.rounds):
        for r in runs:
            res[r].append(step(*r))
    print(f"| rows | body | pages | ms per step, median of {a.rounds} | min | max |")
    print("|---:|---|---|---:|---:|---:|")
    for (m, b, pg), v in res.items():
        print(f"| {m} | {b} | {pg} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} |")
    print("load after", open("/proc/loadavg").read().split()[:3])


if __name__ == "__main__":
    main()
