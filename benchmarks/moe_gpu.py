"""Mixture-of-experts on the H200 (issue 15): fused-MoE tile tuning, and Qwen3-30B-A3B
shapes with dummy bf16 weights (about 61 GB) through the engine.

    python benchmarks/moe_gpu.py --out OUT [--write-configs kernels/configs]

a. tuning: for Mixtral-8x7B (8 experts, 4096 -> 14336, top-2) and Qwen3-30B-A3B (128
   experts, 2048 -> 768, top-8), every candidate tile config at each num_tokens bucket:
   the whole fused_moe (alignment, both grouped GEMMs, SiLU-and-mul, the top-k sum)
   captured in a CUDA graph, median of 20 replays (CUDA events) over random routing;
   beside it the roofline of the expert weights the routing touches (distinct experts x
   3 x hidden x width x 2 bytes) / copy bandwidth. The best config per bucket is written
   as vLLM's `E=..,N=..,device_name=...json` (kernels/fused_moe.py reads it).
b. Qwen3-30B-A3B (config.json's architecture fields, 48 layers, dummy weights): one
   decode step at batch 1 and 64 with 1k context, each request on its own token
   (CUDA-graph replay, LM head, argmax: `decode_step`; gpu_bench.device_step_ms, which
   feeds one token to every request and so routes them all alike, beside it) against
   the roofline of the bytes read: attention and norm
   weights, the router, the experts the step's routing activates (counted in one eager
   forward of the same inputs), the LM head, `batch` embedding rows, the KV of the
   context.
c. offline: 1000 prompts x 200 random tokens, 200 output tokens each (ignore_eos),
   `LLM.generate`, output tok/s; then transformers' `generate_batch` (continuous
   batching, paged attention) on random weights of the same config with
   --hf-layers decoder layers (61 GB twice does not fit beside the engine's KV cache,
   and one transformers layer at a time is what bounds it) and --hf-prompts prompts,
   its output tok/s scaled by hf_layers / 48 (the embedding and LM head are not scaled,
   which flatters transformers).
d. decode path (--decode-compare): one fused_moe layer at T = 1 .. 16 (DECODE_TOKENS) for
   both shapes, the aligned grouped path (tuned tiles) against the alignment-free decode
   path (kernels/fused_moe.py `_fused_moe_decode`) at a few (BLOCK_N, BLOCK_K) tiles
   (DECODE_TILES), CUDA-graph medians as in a., beside the roofline of the experts the
   routing touches, and what `fused_moe` picks by default.
e. profile (--profile): where one batch-1 decode step of b. goes: torch.profiler over
   CUDA-graph replays (and one eager step), kernels grouped by name and by kind
   (attention, MoE, GEMM, norm, ...), their sum against the step's wall time (the rest:
   gaps between kernels in the graph); a table in profile_b1.txt, the chrome trace of
   two replays in profile_b1_trace.json.
The table comes last; JSON in --out.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import shlex
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_loops import busy_and_wall  # noqa: E402
from gpu_bench import copy_bandwidth_gbs, device_step_ms  # noqa: E402

from flowengine.kernels import fused_moe as fused_moe_module  # noqa: E402
from flowengine.kernels.fused_moe import config_file_name, default_config, fused_moe  # noqa: E402
from flowengine.model.layers.moe import FusedMoE, SparseMoeBlock, select_experts  # noqa: E402

# Qwen/Qwen3-30B-A3B's config.json, architecture fields only.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645, "sliding_window": None,
    "use_sliding_window": False,
}
SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768)}
BUCKETS = (1, 16, 64, 256, 1024)
# (BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, num_warps, num_stages)
CANDIDATES = [
    (16, 64, 64, 4, 3),  # the default
    (16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 64, 256, 4, 3),
    (32, 64, 64, 4, 3), (32, 128, 64, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 8, 3),
]
KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps", "num_stages")


def _graph_ms(fn, replays: int = 20) -> float:
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for i in range(replays + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2]


def tune(bw_gbs: float, buckets: tuple[int, ...]) -> tuple[list[dict], dict[str, dict]]:
    rows, files = [], {}
    for model, (e, k, h, i) in SHAPES.items():
        torch.manual_seed(0)
        w13 = (torch.randn(e, 2 * i, h, device="cuda") * h ** -0.5).bfloat16()
        w2 = (torch.randn(e, h, i, device="cuda") * i ** -0.5).bfloat16()
        best: dict[str, dict] = {}
        for m in buckets:
            x = torch.randn(m, h, device="cuda").bfloat16()
            weights, ids = select_experts(torch.randn(m, e, device="cuda"), k, True)
            ref = fused_moe(x, w13, w2, weights, ids, config=default_config(m, 2 * i, h))
            distinct = int(ids.unique().numel())
            roof = distinct * 3 * h * i * 2 / bw_gbs / 1e6
            results = []
            for cand in CANDIDATES:
                cfg = dict(zip(KEYS, cand, strict=True))
                try:
                    out = fused_moe(x, w13, w2, weights, ids, config=cfg)
                    err = float((out.float() - ref.float()).norm() / ref.float().norm())
                    if not err < 1e-2:
                        raise RuntimeError(f"disagrees with the default tiles: {err:.2e}")
                    ms = _graph_ms(functools.partial(fused_moe, x, w13, w2, weights, ids,
                                                     config=cfg))
                except Exception as exc:  # noqa: BLE001 - a tile the GPU cannot run
                    print(f"{model} M={m} {cand}: {type(exc).__name__}: {str(exc)[:100]}",
                          flush=True)
                    continue
                results.append((ms, cand))
                rows.append({"model": model, "M": m, "config": list(cand), "ms": ms,
                             "roofline_ms": roof, "distinct_experts": distinct})
            results.sort()
            default_ms = next(ms for ms, c in results if c == CANDIDATES[0])
            best[str(m)] = dict(zip(KEYS, results[0][1], strict=True))
            print(f"{model} M={m}: best {results[0][1]} {results[0][0]:.4f} ms, default "
                  f"{default_ms:.4f} ms, roofline {roof:.4f} ms ({distinct} experts)",
                  flush=True)
        files[config_file_name(e, i, torch.cuda.get_device_name())] = best
        del w13, w2
        torch.cuda.empty_cache()
    return rows, files


# Tokens per layer call of section d. (2026-12-02 14:55: the decode path won for Qwen3
# up to T = 16 and for Mixtral up to T = 2, grouped at Mixtral's T = 4; T = 32 and
# Mixtral's 3 were not measured: kernels/fused_moe.py decode_pair_limit).
DECODE_TOKENS = {"mixtral-8x7b": (1, 2, 3, 4), "qwen3-30b-a3b": (1, 2, 4, 8, 16, 32)}
# name (gate/up then down tiles, BLOCK_N x BLOCK_K) -> fused_moe_module.DecodeTiles
# fields; "default": DEFAULT_DECODE_TILES (gu4x256/dn4x256 since the 2026-12-02 20:15
# run, docs/benchmarks.md session 28); "s26": session 26's default at Qwen3's T = 1;
# the others change one or two fields from the default.
DECODE_TILES = {
    "default": {},
    "gu8x256/dn4x256": {"gate_up_n": 8},  # session 27's default
    "s26": {"gate_up_n": 16, "gate_up_k": 128, "down_n": 16, "down_k": 64},
    "gu4x512/dn4x256": {"gate_up_k": 512},
    "gu4x256w8/dn4x256": {"gate_up_warps": 8},
    "gu4x256/dn4x256w4": {"down_warps": 4},
    "gu2x512/dn4x256": {"gate_up_n": 2, "gate_up_k": 512},
}


def decode_compare(bw_gbs: float) -> list[dict]:
    """Grouped vs decode path of one MoE layer (section d. of the module docstring)."""
    rows = []
    for model, (e, k, h, i) in SHAPES.items():
        torch.manual_seed(1)
        w13 = (torch.randn(e, 2 * i, h, device="cuda") * h ** -0.5).bfloat16()
        w2 = (torch.randn(e, h, i, device="cuda") * i ** -0.5).bfloat16()
        for m in DECODE_TOKENS[model]:
            x = torch.randn(m, h, device="cuda").bfloat16()
            weights, ids = select_experts(torch.randn(m, e, device="cuda"), k, True)
            distinct = int(ids.unique().numel())
            roof = distinct * 3 * h * i * 2 / bw_gbs / 1e6
            ref = fused_moe(x, w13, w2, weights, ids, decode=False).float()
            row = {"model": model, "T": m, "distinct_experts": distinct, "roofline_ms": roof,
                   "grouped_ms": _graph_ms(functools.partial(
                       fused_moe, x, w13, w2, weights, ids, decode=False)), "decode": {}}
            for name, fields in DECODE_TILES.items():
                fn = functools.partial(fused_moe_module._fused_moe_decode, x, w13, w2,
                                       weights, ids, None,
                                       fused_moe_module.DecodeTiles(**fields))
                try:
                    err = float((fn().float() - ref).norm() / ref.norm())
                    if not err < 1e-2:
                        raise RuntimeError(f"disagrees with the grouped path: {err:.2e}")
                    row["decode"][name] = _graph_ms(fn)
                except Exception as exc:  # noqa: BLE001 - one variant; keep the rest
                    print(f"{model} T={m} decode {name}: {type(exc).__name__}: "
                          f"{str(exc)[:200]}", flush=True)
                    row["decode"][name] = float("nan")
            row["default_ms"] = _graph_ms(functools.partial(fused_moe, x, w13, w2, weights,
                                                            ids))
            row["default_path"] = ("decode" if m * k <= fused_moe_module.decode_pair_limit(i)
                                   else "grouped")
            rows.append(row)
            print(f"decode-compare {row}", flush=True)
        del w13, w2
        torch.cuda.empty_cache()
    return rows


def write_model_dir(path: str, config: dict) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    vocab = {f"<{i}>": i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>").save_pretrained(path)


# Kernel name patterns -> kind, first match wins (section e.).
KERNEL_KINDS = (
    ("moe decode gate/up", ("_decode_gate_up",)), ("moe decode down", ("_decode_down",)),
    ("moe grouped", ("_grouped_gemm", "silu_and_mul", "argsort", "scatter", "searchsorted",
                     "cumsum")),
    ("router top-k (+ GEMV at decode sizes)", ("route_topk", "_router_gemv_topk")),
    ("attention", ("decode_attention", "paged_attention", "attention")),
    ("rotary / KV write", ("rope", "rotary", "reshape_and_cache", "cache")),
    ("norm", ("rms_norm",)),
    ("GEMM (cuBLAS)", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "sm90", "splitk")),
    ("argmax / sampling", ("argmax", "reduce")),
    ("copy / fill", ("copy", "fill", "elementwise", "index")),
)


def _kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, pats in KERNEL_KINDS:
        if any(pat.lower() in low for pat in pats):
            return kind
    return "other"


def profile_steps(step, steps: int, step_ms: float, label: str, trace: str | None) -> dict:
    """torch.profiler over `steps` calls of `step`: per-kernel and per-kind device time
    per step, and the union of kernel intervals against the wall span (gaps)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0]
    if trace:
        try:
            prof.export_chrome_trace(trace)
        except Exception as exc:  # noqa: BLE001 - the table matters more
            print(f"chrome trace not written: {exc}", flush=True)
    if not kernels:
        return {"label": label, "kernels": 0}
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, wall = busy_and_wall(spans)
    rows = sorted(((sum(v) / steps, len(v) / steps, name) for name, v in by_name.items()),
                  reverse=True)
    kinds: dict[str, list[float]] = {}
    for us, calls, name in rows:
        k = kinds.setdefault(_kernel_kind(name), [0.0, 0.0])
        k[0] += us
        k[1] += calls
    return {"label": label, "steps": steps, "step_ms": step_ms,
            "kernels_per_step": len(kernels) / steps, "kernel_us_per_step": busy / steps,
            "span_us_per_step": wall / steps,
            "kernels": [{"name": n, "us": us, "calls": c} for us, c, n in rows],
            "kinds": {k: {"us": v[0], "calls": v[1]} for k, v in
                      sorted(kinds.items(), key=lambda kv: -kv[1][0])}}


def format_profile(p: dict, top: int = 25) -> str:
    if not p.get("kernels"):
        return f"{p['label']}: the profiler recorded no kernels\n"
    lines = [f"{p['label']}: {p['kernels_per_step']:.0f} kernels a step, kernel time "
             f"{p['kernel_us_per_step']:.0f} us of a {p['span_us_per_step']:.0f} us span "
             f"(gaps {p['span_us_per_step'] - p['kernel_us_per_step']:.0f} us); step "
             f"(CUDA events) {p['step_ms'] * 1e3:.0f} us", "",
             "| kind | us / step | kernels / step | % of kernel time |", "|---|---|---|---|"]
    for k, v in p["kinds"].items():
        lines.append(f"| {k} | {v['us']:.1f} | {v['calls']:.0f} | "
                     f"{100 * v['us'] / p['kernel_us_per_step']:.1f} |")
    lines += ["", "| kernel | kind | us / step | calls / step | us / call |",
              "|---|---|---|---|---|"]
    for r in p["kernels"][:top]:
        lines.append(f"| {r['name'][:90]} | {_kernel_kind(r['name'])} | {r['us']:.1f} | "
                     f"{r['calls']:.0f} | {r['us'] / max(r['calls'], 1e-9):.2f} |")
    return "\n".join(lines) + "\n"


@torch.inference_mode()
def decode_step(runner, batch: int, context: int, iters: int = 50,
                profile_dir: str | None = None) -> dict:
    """One decode step of `batch` requests with `context` cached tokens each, every
    request on its own token (so the routing spreads as real traffic's does): median
    device time of the CUDA-graph replay + LM head + argmax (as gpu_bench.device_step_ms,
    which feeds one token to all), and the bytes the step must read: every parameter
    except the expert stacks and the untied embedding, the experts this step's routing
    picks (counted in an eager forward of the same inputs), `batch` embedding rows, the
    KV of the context."""
    from flowengine.executor.input_batch import RequestState
    from flowengine.sampling_params import SamplingParams

    model = runner.model
    bs = runner.cache_config.block_size
    per_req = context // bs + 1
    vocab = runner.model_config.vocab_size
    states = [RequestState(f"b{i}", [(1000 + 7919 * i) % vocab] * (context + 1), context,
                           SamplingParams(), None, list(range(i * per_req, (i + 1) * per_req)),
                           context)
              for i in range(batch)]
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    picked: list[int] = []

    # On the block (its experts route with the router GEMV fused in at decode sizes,
    # `FusedMoE.route_and_forward`, so FusedMoE.forward is not called there).
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]

    def hook(block, args) -> None:
        logits = torch.nn.functional.linear(args[0], block.gate.weight)
        _, ids = select_experts(logits, block.experts.top_k, block.experts.renormalize)
        picked.append(int(ids.unique().numel()))

    inputs = runner.input_batch.prepare(states, [1] * batch)
    handles = [m.register_forward_pre_hook(hook) for m in blocks]
    try:
        model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.attn_metadata)
    finally:
        for hnd in handles:
            hnd.remove()
    graphs = getattr(runner, "graphs", None)
    pad = None if graphs is None else min(s for s in graphs.sizes if s >= batch)
    inputs = runner.input_batch.prepare(states, [1] * batch, pad_to=pad)

    def step(eager: bool = False) -> None:
        if graphs is not None and pad is not None and not eager:
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
    total = 0.0
    expert_params = {id(m.w13_weight) for m in moes} | {id(m.w2_weight) for m in moes}
    for name, p in model.named_parameters():
        if id(p) in expert_params:
            continue
        if name == "model.embed_tokens.weight" and model.lm_head is not None:
            total += batch * p[0].numel() * p.element_size()
        else:
            total += p.numel() * p.element_size()
    for m, n in zip(moes, picked, strict=True):
        total += n * (m.w13_weight[0].numel() + m.w2_weight[0].numel()) * m.w13_weight.element_size()
    kv = runner.kv_cache_bytes_per_block(runner.model_config, 1, runner.kv_cache_dtype)
    ms = sorted(times)[len(times) // 2]
    out = {"ms": ms, "bytes": total + batch * context * kv,
           "distinct_experts": sum(picked) / len(picked), "graphs": pad is not None}
    if profile_dir:
        profiles = []
        try:
            profiles.append(profile_steps(
                step, 20, ms, f"batch {batch}, CUDA-graph replay (size {pad}) + LM head + "
                "argmax, 20 steps", None))
            profiles.append(profile_steps(
                step, 2, ms, f"batch {batch}, 2 replays (trace)",
                os.path.join(profile_dir, f"profile_b{batch}_trace.json")))
            eager_ms = []
            for _ in range(3):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                step(True)
                end.record()
                end.synchronize()
                eager_ms.append(start.elapsed_time(end))
            profiles.append(profile_steps(
                functools.partial(step, True), 3, sorted(eager_ms)[1],
                f"batch {batch}, eager forward (no graph), 3 steps", None))
        except Exception as exc:  # noqa: BLE001 - keep the timings
            print(f"profile failed: {type(exc).__name__}: {exc}", flush=True)
        text = "".join(format_profile(p) + "\n" for p in profiles)
        with open(os.path.join(profile_dir, f"profile_b{batch}.txt"), "w",
                  encoding="utf-8") as f:
            f.write(text)
        print(text, flush=True)
        out["profile"] = [{k: v for k, v in p.items() if k != "kernels"} | {
            "kernels": p.get("kernels", [])[:40]} for p in profiles]
    return out


def qwen3_engine(path: str, bw_gbs: float, num_prompts: int, context: int,
                 batches: tuple[int, ...] = (1, 64), offline: bool = True,
                 profile_dir: str | None = None) -> dict:
    from flowengine import LLM
    from flowengine.bench.throughput import random_prompts, run_flowengine

    out: dict = {}
    t0 = time.perf_counter()
    llm = LLM(path, load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=4096,
              max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.9,
              placement="inproc")  # the runner is read and timed in process
    out["load_s"] = time.perf_counter() - t0
    runner = llm.engine.executor.runner
    out["weight_gb"] = sum(p.numel() * p.element_size()
                           for p in runner.model.parameters()) / 1e9
    print(f"engine up in {out['load_s']:.1f} s, weights {out['weight_gb']:.1f} GB", flush=True)
    for batch in batches:
        r = decode_step(runner, batch, context,
                        profile_dir=profile_dir if batch == batches[0] else None)
        r["roofline_ms"] = r["bytes"] / bw_gbs / 1e6
        r["same_token_ms"] = device_step_ms(runner, batch, context)  # gpu_bench's inputs
        out[f"decode_{batch}"] = r
        print(f"decode batch {batch}: {out[f'decode_{batch}']}", flush=True)
    if not offline:
        llm.shutdown()
        return out
    prompts = random_prompts(num_prompts, 200, QWEN3_30B_A3B["vocab_size"], set(), 0)
    res = run_flowengine(llm, prompts, 200)
    out["offline"] = {"requests": res.num_requests,
                      "elapsed_s": res.elapsed_s, "output_tokens": res.output_tokens,
                      "output_tok_s": res.output_tokens / res.elapsed_s}
    print(f"flowengine offline: {out['offline']}", flush=True)
    llm.shutdown()
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return out


def transformers_offline(path: str, layers: int, num_prompts: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from flowengine.bench.throughput import random_prompts

    config = AutoConfig.from_pretrained(path, num_hidden_layers=layers)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                 attn_implementation="paged|sdpa").eval()
    prompts = random_prompts(num_prompts, 200, QWEN3_30B_A3B["vocab_size"], set(), 0)
    gen = GenerationConfig(max_new_tokens=200, do_sample=False, eos_token_id=None,
                           pad_token_id=0, use_cuda_graph=False)
    # NOTE: not under torch.inference_mode(): generate_batch's manager resets its static
    # tensors in place from its own thread, which inference tensors refuse.
    model.generate_batch(prompts[:4], generation_config=gen)  # warm-up
    start = time.perf_counter()
    results = model.generate_batch(prompts, generation_config=gen)
    elapsed = time.perf_counter() - start
    n_out = sum(len(r.generated_tokens) for r in results.values())
    if n_out < num_prompts * 200:
        raise RuntimeError(f"generate_batch returned {n_out} of {num_prompts * 200} tokens")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    rate = n_out / elapsed
    return {"layers": layers, "requests": num_prompts, "elapsed_s": elapsed,
            "output_tokens": n_out, "output_tok_s": rate,
            "output_tok_s_scaled_48": rate * layers / QWEN3_30B_A3B["num_hidden_layers"]}


def print_decode_compare(rows: list[dict]) -> None:
    tiles = list(DECODE_TILES)
    print("\n| shape | T | experts | grouped ms | " + " | ".join(f"decode {t} ms" for t in tiles)
          + " | fused_moe default ms (path) | roofline ms |")
    print("|---" * (6 + len(tiles)) + "|")
    for r in rows:
        print(f"| {r['model']} | {r['T']} | {r['distinct_experts']} | {r['grouped_ms']:.4f} | "
              + " | ".join(f"{r['decode'][t]:.4f}" for t in tiles)
              + f" | {r['default_ms']:.4f} ({r.get('default_path', '?')}) | "
              f"{r['roofline_ms']:.4f} |", flush=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--write-configs", default=None, help="folder for the tuned JSON files")
    p.add_argument("--skip-tune", action="store_true")
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--hf-layers", type=int, default=4)
    p.add_argument("--hf-prompts", type=int, default=200)
    p.add_argument("--decode-compare", action="store_true",
                   help="time the grouped vs the decode fused-MoE path (section d.)")
    p.add_argument("--decode-batches", default="1,64",
                   help="comma-separated decode batch sizes of section b.")
    p.add_argument("--skip-offline", action="store_true", help="section b. without c.")
    p.add_argument("--profile", action="store_true",
                   help="profile the first --decode-batches step (section e.)")
    ns = p.parse_args(argv)
    os.makedirs(ns.out, exist_ok=True)
    bw = copy_bandwidth_gbs()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    meta = {"command": shlex.join([sys.executable, *sys.argv]),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "copy_bandwidth_gbs": bw}
    results: dict = {}

    def save() -> None:
        with open(os.path.join(ns.out, "moe_gpu.json"), "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)

    if not ns.skip_tune:
        rows, files = tune(bw, BUCKETS)
        results["tuning"] = rows
        for folder in filter(None, (ns.write_configs, os.path.join(ns.out, "configs"))):
            os.makedirs(folder, exist_ok=True)
            for name, cfgs in files.items():
                with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
                    json.dump(cfgs, f, indent=4)
                    f.write("\n")
        save()
    if ns.decode_compare:
        results["decode_compare"] = decode_compare(bw)
        save()
        print_decode_compare(results["decode_compare"])
    batches = tuple(int(b) for b in ns.decode_batches.split(","))
    path = tempfile.mkdtemp(prefix="qwen3-30b-a3b-")
    if not ns.skip_model:
        write_model_dir(path, QWEN3_30B_A3B)
        results["qwen3"] = qwen3_engine(path, bw, ns.num_prompts, ns.context, batches,
                                        not ns.skip_offline,
                                        ns.out if ns.profile else None)
        save()
    if not ns.skip_hf:
        if not os.path.exists(os.path.join(path, "config.json")):
            write_model_dir(path, QWEN3_30B_A3B)
        try:
            results["transformers"] = transformers_offline(path, ns.hf_layers, ns.hf_prompts)
        except Exception as exc:  # noqa: BLE001 - report, keep the other numbers
            results["transformers"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        print(f"transformers: {results['transformers']}", flush=True)
        save()

    print(f"\n{meta['gpu']}, torch {meta['torch']}, {meta['date']}, copy {bw:.0f} GB/s")
    print(f"command: {meta['command']}\n")
    if "tuning" in results:
        print("| shape | M | default ms | tuned ms | tuned config (BM,BN,BK,warps,stages) | "
              "roofline ms |")
        print("|---|---|---|---|---|---|")
        for model in SHAPES:
            for m in BUCKETS:
                rs = [r for r in results["tuning"] if r["model"] == model and r["M"] == m]
                if not rs:
                    continue
                d = next((r for r in rs if r["config"] == list(CANDIDATES[0])), None)
                b = min(rs, key=lambda r: r["ms"])
                print(f"| {model} | {m} | {d['ms'] if d else float('nan'):.4f} | "
                      f"{b['ms']:.4f} | {tuple(b['config'])} | {b['roofline_ms']:.4f} |")
    if "decode_compare" in results:
        print_decode_compare(results["decode_compare"])
    q = results.get("qwen3")
    for p in (q or {}).get(f"decode_{batches[0]}", {}).get("profile", []):
        if "kinds" in p:
            print(f"\nprofile: {p['label']}: {p['kernels_per_step']:.0f} kernels, "
                  f"{p['kernel_us_per_step']:.0f} us of kernels in a "
                  f"{p['span_us_per_step']:.0f} us span; " + ", ".join(
                      f"{k} {v['us']:.0f}" for k, v in p["kinds"].items()))
    if q:
        print("\n| Qwen3-30B-A3B dummy bf16 | GB read | ms | roofline ms | x roofline |")
        print("|---|---|---|---|---|")
        for batch in batches:
            r = q[f"decode_{batch}"]
            print(f"| decode batch {batch}, {ns.context} ctx ({r['distinct_experts']:.1f} "
                  f"experts/layer) | {r['bytes'] / 1e9:.2f} | {r['ms']:.3f} | "
                  f"{r['roofline_ms']:.3f} | {r['ms'] / r['roofline_ms']:.2f} |")
    if q and "offline" in q:
        o = q["offline"]
        print(f"\nflowengine offline {ns.num_prompts} x 200/200: {o['output_tok_s']:.1f} "
              f"output tok/s ({o['elapsed_s']:.1f} s)")
    t = results.get("transformers")
    if t and "error" not in t:
        print(f"transformers generate_batch, {t['layers']} layers, {t['requests']} prompts: "
              f"{t['output_tok_s']:.1f} output tok/s -> {t['output_tok_s_scaled_48']:.1f} "
              "scaled to 48 layers")
        if q and "offline" in q:
            print(f"ratio flowengine / transformers (scaled): "
                  f"{q['offline']['output_tok_s'] / t['output_tok_s_scaled_48']:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
