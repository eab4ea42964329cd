"""Decode-step time of the quantized CPU path by batch rows (issue #20).

    python benchmarks/cpu_decode_rows.py                    # rows 1,2,3,4,8,16, bf16
    ROWS=4,8 ROUNDS=5 DTYPE=float32 python benchmarks/cpu_decode_rows.py

Per round and row count R: R prompts of 128 distinct token ids, `LLM.generate` with 1
token (the prefill) and with NT tokens (default 65); the decode step is
(t(NT) - t(1)) / (NT - 1) in ms, so contexts run 128 -> 128 + NT. Prints the median over
ROUNDS (default 3) and every round, with the load average before and after. The C
extension reads its switches once per process, so compare configurations in separate
processes, alternated, e.g. the AMX-INT8 body against the AMX-BF16 body (which then
starts at quant_linear.AMX_BF16_MIN_ROWS, the thresholds the former replaced):

    for i in 1 2; do
        python benchmarks/cpu_decode_rows.py
        FLOWENGINE_CPU_NO_AMX_INT8=1 python benchmarks/cpu_decode_rows.py
    done

AMX_ROWS=Q4,Q8 overrides where the AMX-INT8 body starts for the Q4 formats and Q8_0
(quant_linear.AMX_ROWS[fmt][0]). Env GGUF: the model file (default model's Q4_1).
"""

from __future__ import annotations

import os
import statistics
import time

import flowengine  # noqa: F401  (sets the wait policy before torch loads threads)
import flowengine.model.layers.quant_linear as ql
from flowengine import LLM, SamplingParams

GGUF = os.environ.get("GGUF", os.path.expanduser(
    "~/.cache/flowengine/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"))


def main() -> None:
    if os.environ.get("AMX_ROWS"):
        q4, q8 = (int(v) for v in os.environ["AMX_ROWS"].split(","))
        for fmt, start in (("q4_0", q4), ("q4_1", q4), ("q8_0", q8)):
            ql.AMX_ROWS[fmt] = (start, ql.AMX_ROWS[fmt][1])
    rows = [int(r) for r in os.environ.get("ROWS", "1,2,3,4,8,16").split(",")]
    nt = int(os.environ.get("NT", "65"))
    llm = LLM(GGUF, quantization="gguf", enable_prefix_caching=False, cpu_threads=2,
              max_model_len=1024, dtype=os.environ.get("DTYPE", "bfloat16"))
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=nt, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    print("load before", open("/proc/loadavg").read().split()[:3])
    res: dict[int, list[float]] = {r: [] for r in rows}
    for _ in range(int(os.environ.get("ROUNDS", "3"))):
        for r in rows:
            prompts = [{"prompt_token_ids": [1000 + 7 * i + j for j in range(128)]}
                       for i in range(r)]
            llm.generate(prompts, warm, use_tqdm=False)
            t0 = time.perf_counter()
            llm.generate(prompts, one, use_tqdm=False)
            t1 = time.perf_counter()
            llm.generate(prompts, many, use_tqdm=False)
            t2 = time.perf_counter()
            res[r].append(((t2 - t1) - (t1 - t0)) / (nt - 1) * 1e3)
    print("| rows | ms per decode step, median | rounds |")
    print("|---:|---:|---|")
    for r in rows:
        print(f"| {r} | {statistics.median(res[r]):.2f} | "
              + " / ".join(f"{x:.2f}" for x in res[r]) + " |")
    print("load after", open("/proc/loadavg").read().split()[:3])


if __name__ == "__main__":
    main()
