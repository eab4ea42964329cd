"""GPU measurements of issue 5, point 5 (a, b, d), at Llama-3.1-8B shapes with random
(load_format="dummy") bf16 weights.

    python benchmarks/gpu_bench.py --out /tmp/bench           # a, b, d
    python benchmarks/gpu_bench.py --write-config DIR         # config + tokenizer for (c)

a. decode at batch 1, 1k context: ms per token; b. one decode step at batch 256 x 1k
context: ms; each beside its memory roofline = (weight bytes + KV bytes read per step)
/ the device-to-device copy bandwidth measured in the same run ((read + written bytes)
/ time of a 4 GiB copy). Three figures each: the engine with two steps in flight
(scheduler, runner, sampler; the overlap of DESIGN.md §5), the engine one step at a
time (EngineCore.step, today's LLM path), and the device step alone (CUDA-graph replay,
LM head and argmax on prepared inputs, timed with CUDA events).
d. the fraction of GPU time idle between steps during (b)'s steady decode, from CUDA
events around each step's launch and from torch.profiler's kernel timeline.
The markdown table comes last, with the command, date and GPU; JSON goes to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shlex
import string
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_loops import (  # noqa: E402
    idle_between_steps,
    profiler_idle,
    run_overlapped,
    run_sync,
    steady_decode,
    step_time_ms,
)

from flowengine.config import EngineArgs  # noqa: E402
from flowengine.engine.builder import build_engine_core, resolve  # noqa: E402
from flowengine.engine.engine_core import EngineCore  # noqa: E402
from flowengine.executor.cuda_runner import CudaModelRunner  # noqa: E402
from flowengine.executor.input_batch import RequestState  # noqa: E402
from flowengine.messages import NewRequest  # noqa: E402
from flowengine.model.layers.fp8 import Fp8Linear  # noqa: E402
from flowengine.sampling_params import SamplingParams  # noqa: E402

# Llama-3.1-8B's config.json (meta-llama/Llama-3.1-8B), architecture fields only.
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 128000,
    "eos_token_id": 128001,
}


def write_model_dir(path: str, with_tokenizer: bool) -> None:
    """config.json of LLAMA_31_8B, plus a word-level tokenizer of one token per id
    (enough for `flowengine bench throughput`, which sends token ids)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(LLAMA_31_8B, f, indent=1)
    if with_tokenizer:
        from tokenizers import Regex, Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        # Ids 0-25 are the letters a-z, every other id the word "<id>". `flowengine bench
        # serve`'s random prompts are pronounceable words: they become one token per
        # letter, so prompts differ from their first tokens on (with "<id>" words only,
        # every word was the unknown token and all prompts the same: a served run then
        # hit the prefix cache for 96% of its prompt tokens and skipped the prefill
        # that the offline run, which sends random ids, does). "<5>" stays one token,
        # and decode -> encode keeps a prompt's length (bench serve sends text).
        vocab = {f"<{i}>": i for i in range(LLAMA_31_8B["vocab_size"])}
        for i, c in enumerate(string.ascii_lowercase):
            del vocab[f"<{i}>"]
            vocab[c] = i
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<26>"))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Split(Regex(r"<\d+>|."), behavior="isolated")])
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>").save_pretrained(path)


def copy_bandwidth_gbs(gib: int = 4, iters: int = 20) -> float:
    """Device-to-device copy bandwidth, (bytes read + bytes written) / time, GB/s."""
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


def gemm_rate_tflops(fp8: bool, n: int = 8192, iters: int = 20) -> float:
    """Dense GEMM rate on random data, n x n x n, TFLOP/s: bf16 through torch.matmul, or
    E4M3 through torch._scaled_mm (per-row / per-column fp32 scales, bf16 out, as the
    FP8 layers call it). The ceiling of (b)'s per-kernel floor, measured in this run."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    if fp8:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
        sa = torch.ones(n, 1, device="cuda", dtype=torch.float32)
        sb = torch.ones(1, n, device="cuda", dtype=torch.float32)

        def op() -> None:
            torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    else:
        def op() -> None:
            torch.matmul(a, b)
    for _ in range(3):
        op()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        op()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / sorted(times)[len(times) // 2] / 1e12


def per_kernel_floor_ms(runner: CudaModelRunner, batch: int, context: float, bw_gbs: float,
                        gemm_tflops: float) -> dict[str, float]:
    """(b)'s per-kernel floor: the K/V bytes of `context` tokens per request at copy
    bandwidth + the projections' and LM head's FLOPs (2 x batch x in x out each) at the
    measured GEMM rate (each GEMM taken as compute-bound, true from batch ~256 up)."""
    model = runner.model
    embed = model.model.embed_tokens.weight
    macs = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and w.ndim == 2 and w is not embed:
            macs += w.shape[0] * w.shape[1]
    if model.lm_head is None:  # tied: the LM head reads the embedding table
        macs += embed.numel()
    kv_per_token = runner.kv_cache_bytes_per_block(runner.model_config, 1, runner.kv_cache_dtype)
    attn_ms = batch * context * kv_per_token / (bw_gbs * 1e9) * 1e3
    gemm_ms = 2 * batch * macs / (gemm_tflops * 1e12) * 1e3
    return {"floor_attn_ms": attn_ms, "floor_gemm_ms": gemm_ms, "floor_ms": attn_ms + gemm_ms,
            "gemm_tflop_per_step": 2 * batch * macs / 1e12}


def bytes_per_step(runner: CudaModelRunner, batch: int, context: float) -> float:
    """Bytes a decode step must read: every weight but an untied embedding table (only
    `batch` rows of it), and the K/V of `context` tokens per request."""
    model = runner.model
    embed = model.model.embed_tokens.weight
    # Parameters, plus the E4M3 weights and scales of --quantization fp8 (buffers).
    tensors = [*model.parameters(),
               *(b for m in model.modules() if isinstance(m, Fp8Linear)
                 for b in (m.weight, m.weight_scale))]
    weights = sum(t.numel() * t.element_size() for t in tensors)
    if model.lm_head is not None:  # untied: the table is read only at the batch's ids
        weights += (batch - embed.shape[0]) * embed[0].numel() * embed.element_size()
    kv_per_token = runner.kv_cache_bytes_per_block(
        runner.model_config, 1, runner.kv_cache_dtype)
    return weights + batch * context * kv_per_token


@torch.inference_mode()
def device_step_ms(runner: CudaModelRunner, batch: int, context: int, iters: int = 50) -> float:
    """Median time of the device work of one decode step on prepared inputs: CUDA-graph
    replay (eager forward with enforce_eager), LM head and argmax; `batch` requests of
    `context` cached tokens each over distinct KV blocks."""
    bs = runner.cache_config.block_size
    per_req = context // bs + 1
    states = [RequestState(str(i), [1] * (context + 1), context, SamplingParams(), None,
                           list(range(i * per_req, (i + 1) * per_req)), context)
              for i in range(batch)]
    graphs = runner.graphs
    pad = None if graphs is None else min(s for s in graphs.sizes if s >= batch)
    inputs = runner.input_batch.prepare(states, [1] * batch, pad_to=pad)
    model = runner.model

    def step() -> None:
        if graphs is not None and pad is not None:
            hidden = graphs.replay(pad)
        else:
            hidden = model(inputs.input_ids, inputs.positions, runner.kv_caches,
                           inputs.attn_metadata)
        model.compute_logits(hidden.index_select(0, inputs.logits_indices)).argmax(-1)

    times = []
    for i in range(iters + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def add_requests(engine: EngineCore, tag: str, batch: int, context: int, max_tokens: int) -> None:
    """`batch` greedy requests of `context` random prompt tokens (distinct per tag, so
    no prefix-cache hits across phases), each generating max_tokens tokens."""
    rng = random.Random(tag)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # Ids inside the vocabulary of any --model (SmolLM2 has 49,152; an id past it is a
    # device-side assert in the embedding).
    top = min(100000, engine.executor.runner.model_config.vocab_size)
    for i in range(batch):
        prompt = [rng.randrange(1000, top) for _ in range(context)]
        engine.add_request(NewRequest(f"{tag}{i}", prompt, params, 0.0))


def measure(engine: EngineCore, batch: int, context: int, steps: int, budget: int, bw_gbs: float,
            profile: bool, gemm_tflops: float) -> dict[str, float | None]:
    """Engine (overlapped and sync) and device-only decode times at one batch size."""
    prefill_steps = -(-batch * context // budget)
    max_tokens = prefill_steps + steps + 16
    runner = engine.executor.runner
    out: dict[str, float | None] = {}
    for mode, run in (("overlapped", run_overlapped), ("sync", run_sync)):
        add_requests(engine, f"{mode}-{batch}-", batch, context, max_tokens)
        decode = steady_decode(run(engine), batch)
        out[f"{mode}_ms"] = step_time_ms(decode)
        out[f"{mode}_idle"] = idle_between_steps(decode)
    # The mean context of the measured steps (the prompt plus about half the outputs).
    mean_context = context + prefill_steps + steps // 2
    out["context"] = mean_context
    out["device_ms"] = device_step_ms(runner, batch, mean_context)
    out["roofline_ms"] = bytes_per_step(runner, batch, mean_context) / (bw_gbs * 1e9) * 1e3
    out.update(per_kernel_floor_ms(runner, batch, mean_context, bw_gbs, gemm_tflops))
    out["profiler_idle"] = None
    if profile:
        # Long enough that no request ends within the 4 + 16 steady steps below.
        add_requests(engine, f"profile-{batch}-", batch, context, prefill_steps + 80)

        def decoding(n: int):  # noqa: ANN202
            return lambda logs: sum(s.is_decode and s.num_reqs == batch for s in logs) >= n

        run_overlapped(engine, until=decoding(4))  # prefill, into steady decode
        out["profiler_idle"] = profiler_idle(lambda: run_overlapped(engine, until=decoding(16)))
        run_overlapped(engine)  # finish the requests
    return out


def kernel_profile(runner: CudaModelRunner, batch: int, context: int, iters: int = 10) -> str:
    """Top CUDA kernels by self time over `iters` eager device steps (graphs off, so the
    profiler names every kernel): where a step's time goes against its roofline."""
    graphs, runner.graphs = runner.graphs, None
    try:
        device_step_ms(runner, batch, context, iters=2)  # warm-up of the eager path
        activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            device_step_ms(runner, batch, context, iters=iters)
    finally:
        runner.graphs = graphs
    return prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12,
                                     max_name_column_width=70)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", help="directory for gpu_bench.json")
    p.add_argument("--write-config", metavar="DIR",
                   help="only write the Llama-3.1-8B config.json and a tokenizer to DIR")
    p.add_argument("--model", help="a directory with config.json (default: Llama-3.1-8B shapes)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=128, help="steady decode steps measured")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--quantization", choices=["fp8"], default=None)
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    p.add_argument("--no-profile", action="store_true", help="skip the torch.profiler pass")
    p.add_argument("--kernel-profile", action="store_true",
                   help="also print the top CUDA kernels of eager steps at batch 1 and --batch")
    ns = p.parse_args(argv)
    if ns.write_config:
        write_model_dir(ns.write_config, with_tokenizer=True)
        print(f"wrote {ns.write_config}")
        return 0
    if not ns.out:
        p.error("--out is required (or --write-config)")
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    model_dir = ns.model or tempfile.mkdtemp(prefix="llama31-8b-")
    if ns.model is None:
        write_model_dir(model_dir, with_tokenizer=False)
    bw = copy_bandwidth_gbs()
    gemm_bf16 = gemm_rate_tflops(fp8=False)
    gemm_fp8 = gemm_rate_tflops(fp8=True) if ns.quantization == "fp8" else None
    torch.cuda.empty_cache()
    args = EngineArgs(model=model_dir, load_format="dummy", dtype="bfloat16", device="cuda",
                      max_model_len=ns.max_model_len, max_num_seqs=max(ns.batch, 1),
                      max_num_batched_tokens=ns.max_num_batched_tokens,
                      gpu_memory_utilization=ns.gpu_memory_utilization,
                      enforce_eager=ns.enforce_eager, quantization=ns.quantization,
                      kv_cache_dtype=ns.kv_cache_dtype)
    engine = build_engine_core(resolve(args))
    if not isinstance(engine.executor.runner, CudaModelRunner):
        raise RuntimeError("expected the CUDA runner; is the device CUDA?")
    results = {f"batch{b}": measure(engine, b, ns.context, ns.steps if b == 1 else 32,
                                    ns.max_num_batched_tokens, bw, not ns.no_profile and b > 1,
                                    gemm_fp8 or gemm_bf16)
               for b in (1, ns.batch)}
    command = shlex.join([sys.executable, *sys.argv])
    meta = {"command": command, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "copy_bandwidth_gbs": bw,
            "gemm_bf16_tflops": gemm_bf16, "gemm_fp8_tflops": gemm_fp8,
            "num_kv_blocks": engine.executor.runner.cache_config.num_blocks}
    os.makedirs(ns.out, exist_ok=True)
    with open(os.path.join(ns.out, "gpu_bench.json"), "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    if ns.kernel_profile:
        for b in (1, ns.batch):
            table = kernel_profile(engine.executor.runner, b, ns.context)
            print(f"\nkernels of one eager decode step, batch {b} x {ns.context} context "
                  f"(10 steps):\n{table}")
            with open(os.path.join(ns.out, f"kernels_batch{b}.txt"), "w", encoding="utf-8") as f:
                f.write(table)
    print_table(meta, results, ns)
    return 0


def print_table(meta: dict, results: dict, ns: argparse.Namespace) -> None:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    print(f"\ncommand: {meta['command']}\ndate: {meta['date']}\nGPU: {meta['gpu']} "
          f"(torch {meta['torch']}), copy bandwidth {meta['copy_bandwidth_gbs']:.0f} GB/s, "
          f"GEMM 8192^3 bf16 {meta['gemm_bf16_tflops']:.0f} TFLOP/s"
          + (f", E4M3 {meta['gemm_fp8_tflops']:.0f} TFLOP/s" if meta["gemm_fp8_tflops"] else "")
          + "\n")
    print("| measurement | engine, 2 steps in flight | engine, 1 step at a time | device "
          "step only | roofline | ratio 2 in flight / roofline | ratio device / roofline "
          "| target |")
    print("|---|---|---|---|---|---|---|---|")
    for key, name, target in (("batch1", f"a. decode ms/token, batch 1 x {ns.context} ctx",
                               "<= 1.15x"),
                              (f"batch{ns.batch}",
                               f"b. decode step ms, batch {ns.batch} x {ns.context} ctx",
                               "<= 1.25x")):
        r = results[key]
        print(f"| {name} (mean ctx {r['context']}) | {r['overlapped_ms']:.3f} | {r['sync_ms']:.3f} "
              f"| {r['device_ms']:.3f} | {r['roofline_ms']:.3f} "
              f"| {r['overlapped_ms'] / r['roofline_ms']:.2f}x "
              f"| {r['device_ms'] / r['roofline_ms']:.2f}x | {target} |")
    r = results[f"batch{ns.batch}"]
    print(f"| b. per-kernel floor (K/V {r['floor_attn_ms']:.3f} ms at copy bw + "
          f"{r['gemm_tflop_per_step']:.2f} TFLOP at the measured GEMM rate "
          f"{r['floor_gemm_ms']:.3f} ms) | {r['floor_ms']:.3f} | | | | "
          f"{r['overlapped_ms'] / r['floor_ms']:.2f}x | {r['device_ms'] / r['floor_ms']:.2f}x "
          "| bf16 <= 1.2x |")
    print(f"| d. GPU idle between steps during (b), CUDA events | {pct(r['overlapped_idle'])} "
          f"| {pct(r['sync_idle'])} | | | | | < 5% |")
    print(f"| d. GPU idle during (b), profiler kernel timeline | {pct(r['profiler_idle'])} "
          "| | | | | | < 5% |")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
