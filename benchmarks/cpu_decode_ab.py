"""Decode-step time of the quantized CPU path, configurations alternated in ONE process.

    python benchmarks/cpu_decode_ab.py "THR=1" "" "FLOWENGINE_CPU_NO_POOL=1" \\
        "FUSED=0,FLOWENGINE_CPU_NO_POOL=1" "THR=1,FUSED=0,FLOWENGINE_CPU_NO_POOL=1"

Each argument is a configuration: comma-separated KEY=VALUE, where THR sets
torch.set_num_threads (the executor's intra-op threads, read per call by the kernels),
FUSED=0 turns off the one-call decoder layers (layers/cpu_fused.py), KV=float16 (or
bfloat16) runs an engine whose KV cache is of that dtype (`--kv-cache-dtype`; float16 is
the default for GGUF weights) and KV=float32 one with `--dtype float32` (a float32 cache;
one engine per KV value, all built first), and other keys are
environment variables (FLOWENGINE_CPU_NO_POOL=1: OpenMP regions instead of the decode
thread pool; the C module reads it once, so it must be the same in every configuration
of a run, or be compared in separate runs). Per round and configuration: ROWS (default
1) prompts of 128 distinct token ids, 1 token (prefill) and 65 tokens; the decode step of
ROWS rows is (t65 - t1) / 64, contexts 128 -> 193. The rounds
alternate the configurations, so a busy neighbour costs them alike; prints median, min
and first quartile in ms per decode step, with the load average before and after
(issue #20, docs/benchmarks.md). Env: ROUNDS (default 8), GGUF (default model's Q4_1).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

import flowengine  # noqa: F401  (sets the wait policy before torch loads threads)
import flowengine.model.layers.cpu_fused as cpu_fused
from flowengine import LLM, SamplingParams

GGUF = os.environ.get("GGUF", os.path.expanduser(
    "~/.cache/flowengine/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"))


def main() -> None:
    configs = [dict(kv.split("=", 1) for kv in c.split(",")) if c else {} for c in sys.argv[1:]]
    if not configs:
        configs = [{}]
    own = {"THR", "FUSED", "KV"}
    keys = sorted({k for c in configs for k in c} - own)
    llms = {kv: LLM(GGUF, quantization="gguf", enable_prefix_caching=False, cpu_threads=2,
                    max_model_len=1024, placement="inproc",
                    **({"dtype": "float32"} if kv == "float32" else {"kv_cache_dtype": kv}))
            for kv in dict.fromkeys(c.get("KV", "auto") for c in configs)}
    rows = int(os.environ.get("ROWS", "1"))
    prompt = [{"prompt_token_ids": list(range(1000 + 128 * r, 1128 + 128 * r))}
              for r in range(rows)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True)
    res: list[list[float]] = [[] for _ in configs]
    print("load", open("/proc/loadavg").read().strip())
    for _ in range(int(os.environ.get("ROUNDS", "8"))):
        for i, c in enumerate(configs):
            for k in keys:
                os.environ.pop(k, None)
            os.environ.update({k: v for k, v in c.items() if k not in own})
            llm = llms[c.get("KV", "auto")]
            cpu_fused.ENABLED = c.get("FUSED", "1") == "1"
            torch.set_num_threads(int(c.get("THR", "2")))
            llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2,
                                                ignore_eos=True), use_tqdm=False)
            t0 = time.perf_counter()
            llm.generate(prompt, one, use_tqdm=False)
            t1 = time.perf_counter()
            llm.generate(prompt, many, use_tqdm=False)
            t2 = time.perf_counter()
            res[i].append(((t2 - t1) - (t1 - t0)) / 64 * 1000)
    print("load", open("/proc/loadavg").read().strip())
    for c, v in zip(configs, res, strict=True):
        v = sorted(v)
        print(f"{str(c):64s} median {statistics.median(v):6.2f}  min {v[0]:6.2f}  "
              f"q1 {v[len(v) // 4]:6.2f} ms/step")


if __name__ == "__main__":
    main()
