"""Tensor parallelism on GPUs (issue 6): TP=2 against TP=1 at Llama-3.1-8B shapes.

    python benchmarks/tp_bench.py --out $OUT            # on a host with >= 2 GPUs

1. Saves a random-weight model with Llama-3.1-8B's shapes (hidden 4096, 32 layers,
   32 query / 8 KV heads, intermediate 14336, vocab 128256, llama3 RoPE) as bf16
   safetensors, built by transformers on the GPU; the embedding and LM head are shaped
   for clear greedy margins (tests/gpu/gpu_models.py explains why), so that greedy
   decoding is well defined under bf16 rounding.
2. For each tensor-parallel size, one `LLM(placement="multiproc")` (the same actor
   pipeline and processes for every size): greedy token ids of 16 prompts x 32 tokens;
   decode latency at batch 1 (ms per output token: time of a 257-token generation
   minus a 1-token one, over 256, best of 3, 128-token prompt); offline throughput
   (random prompts, ignore_eos): requests/s, output tokens/s, total tokens/s.
3. Checks that every size's greedy ids equal TP=1's, then prints a markdown table
   with the command. JSON goes to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shlex
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "gpu"))

from gpu_models import save_model  # noqa: E402

from flowengine import LLM, SamplingParams  # noqa: E402

LLAMA_31_8B_SIZES = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128)


def _prompts(rng: random.Random, num: int, length: int) -> list[list[int]]:
    return [[rng.randrange(128256) for _ in range(length)] for _ in range(num)]


def _timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def _margin(logprobs: dict) -> float:
    ranked = sorted((lp.logprob for lp in logprobs.values()), reverse=True)
    return ranked[0] - ranked[1] if len(ranked) > 1 else float("inf")


def measure(path: str, tp: int, ns: argparse.Namespace) -> dict:
    """Greedy ids, batch-1 decode latency and offline throughput at one TP size."""
    args = dict(tensor_parallel_size=tp, placement="multiproc", dtype=ns.dtype,
                max_model_len=ns.max_model_len, max_num_seqs=ns.max_num_seqs,
                gpu_memory_utilization=0.85, seed=0)
    start = time.perf_counter()
    llm = LLM(path, **args)
    result: dict = {"tp": tp, "startup_s": time.perf_counter() - start}
    try:
        rng = random.Random(0)
        greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
        _, outs = _timed(llm, _prompts(rng, 16, 64), greedy)
        result["greedy_ids"] = [list(o.outputs[0].token_ids) for o in outs]
        # Gap between the two most likely tokens (logprob units) at every position.
        result["greedy_margins"] = [[_margin(lp) for lp in o.outputs[0].logprobs]
                                    for o in outs]
        if ns.skip_perf:
            return result
        prompt = _prompts(rng, 1, 128)
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        many = SamplingParams(temperature=0, max_tokens=257, ignore_eos=True)
        _timed(llm, prompt, many)  # warm-up
        best = min(_timed(llm, prompt, many)[0] - _timed(llm, prompt, one)[0]
                   for _ in range(3))
        result["decode_ms_per_token_b1"] = best / 256 * 1e3
        prompts = _prompts(rng, ns.num_prompts, ns.input_len)
        params = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
        elapsed, outs = _timed(llm, prompts, params)
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result.update(throughput_s=elapsed, requests_per_s=len(prompts) / elapsed,
                      output_tok_per_s=out_tokens / elapsed,
                      total_tok_per_s=(out_tokens + ns.num_prompts * ns.input_len) / elapsed)
    finally:
        llm.shutdown()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--model-dir", default=None, help="reuse a saved model directory")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--embed-std", type=float, default=16.0,
                   help="embedding std of the saved model (greedy margins, gpu_models.py)")
    p.add_argument("--skip-perf", action="store_true", help="greedy comparison only")
    p.add_argument("--out", default=None, help="directory for results JSON")
    ns = p.parse_args()
    path = ns.model_dir or tempfile.mkdtemp(prefix="llama8b-random-")
    if not os.path.exists(os.path.join(path, "config.json")):
        start = time.perf_counter()
        save_model("llama3", path, seed=0, device="cuda", embed_std=ns.embed_std,
                   **LLAMA_31_8B_SIZES)
        torch.cuda.empty_cache()
        print(f"saved the random model in {time.perf_counter() - start:.0f} s", flush=True)
    results = []
    for tp in ns.tp:
        results.append(measure(path, tp, ns))
        r = results[-1]
        margins = [m for seq in r["greedy_margins"] for m in seq]
        print(f"TP={tp}: startup {r['startup_s']:.0f} s, smallest greedy margin "
              f"{min(margins):.3f}, median {sorted(margins)[len(margins) // 2]:.3f} (logprob)",
              flush=True)
        if not ns.skip_perf:
            print(f"TP={tp}: {r['decode_ms_per_token_b1']:.2f} ms/token, "
                  f"{r['output_tok_per_s']:.0f} output tok/s", flush=True)
    reference = results[0]["greedy_ids"]
    for r in results:
        r["greedy_equal_to_first"] = r["greedy_ids"] == reference
        r["greedy_mismatches"] = [  # (prompt, position, reference margin there)
            (i, pos, results[0]["greedy_margins"][i][pos])
            for i, (a, b) in enumerate(zip(r["greedy_ids"], reference, strict=True)) if a != b
            for pos in [next(k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)]]
        for m in r["greedy_mismatches"]:
            print(f"TP={r['tp']}: prompt {m[0]} differs from position {m[1]}, where the "
                  f"reference margin is {m[2]:.4f}")
    if ns.out:
        os.makedirs(ns.out, exist_ok=True)
        with open(os.path.join(ns.out, "tp_bench.json"), "w") as f:
            json.dump(results, f, indent=1)
    gpu = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
           if torch.cuda.is_available() else "CPU")
    print(f"\n{datetime.date.today()}, {gpu}, {ns.dtype}, torch "
          f"{torch.__version__}\n\n```\npython benchmarks/tp_bench.py "
          f"{shlex.join(sys.argv[1:])}\n```\n")
    print(f"| TP | greedy ids = TP={ns.tp[0]} (16 x 32) | decode ms/token, batch 1 | "
          f"requests/s | output tok/s | total tok/s ({ns.num_prompts} x "
          f"{ns.input_len}/{ns.output_len}) |\n|---|---|---|---|---|---|")
    for r in results:
        if ns.skip_perf:
            print(f"| {r['tp']} | {'yes' if r['greedy_equal_to_first'] else 'NO'} | | | | |")
            continue
        print(f"| {r['tp']} | {'yes' if r['greedy_equal_to_first'] else 'NO'} | "
              f"{r['decode_ms_per_token_b1']:.2f} | {r['requests_per_s']:.2f} | "
              f"{r['output_tok_per_s']:.0f} | {r['total_tok_per_s']:.0f} |")
    if not all(r["greedy_equal_to_first"] for r in results):
        raise SystemExit("greedy ids differ between tensor-parallel sizes")


if __name__ == "__main__":
    main()
