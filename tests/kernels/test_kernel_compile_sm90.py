"""Every kernel compiles for an H100/H200 (sm_90) — checked without a GPU.

The interpreter runs kernels as numpy and so misses what only the compiler rejects
(loop-carried types, tl.dot shape limits, constexpr misuse). Triton compiles to a
cubin with its bundled ptxas for any target, no device needed. The compile runs in a
child process because the parent has TRITON_INTERPRET=1 set, which turns
`triton.jit` into the interpreter for the whole process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# Llama-3-8B launch parameters as the wrappers choose them, bf16; plus SmolLM2's
# decode shape (QPK 3, head_dim 64) for the paged kernel.
LLAMA_ATTN = {"HEAD_DIM": 128, "HEAD_DIM_PADDED": 128, "BLOCK_SIZE": 16, "TILE_N": 32,
              "DOT_PRECISION": "tf32"}
KERNELS: list[tuple[str, str, dict[str, object]]] = [
    ("paged_attention", "_paged_attention_kernel",
     {**LLAMA_ATTN, "QPK": 4, "BLOCK_Q": 16, "BLOCK_M": 64, "WIDEN_FP16": False,
      "SLIDING": False, "SOFT_CAP": False}),
    ("paged_attention", "_paged_attention_kernel",
     {**LLAMA_ATTN, "HEAD_DIM": 64, "HEAD_DIM_PADDED": 64, "QPK": 3, "BLOCK_Q": 5,
      "BLOCK_M": 16, "WIDEN_FP16": False, "SLIDING": False, "SOFT_CAP": False}),
    # Gemma 2 9B: head_dim 256, QPK 2, sliding window and soft-capping on.
    ("paged_attention", "_paged_attention_kernel",
     {**LLAMA_ATTN, "HEAD_DIM": 256, "HEAD_DIM_PADDED": 256, "QPK": 2, "BLOCK_Q": 32,
      "BLOCK_M": 64, "WIDEN_FP16": False, "SLIDING": True, "SOFT_CAP": True}),
    # Fused MoE grouped GEMMs at Qwen3-30B-A3B's shapes (gate/up, then down).
    ("fused_moe", "_grouped_gemm_kernel",
     {"TOP_K": 8, "A_BY_TOKEN": True, "MUL_WEIGHT": False, "BLOCK_M": 16, "BLOCK_N": 64,
      "BLOCK_K": 64, "DOT_PRECISION": "tf32"}),
    ("fused_moe", "_grouped_gemm_kernel",
     {"TOP_K": 8, "A_BY_TOKEN": False, "MUL_WEIGHT": True, "BLOCK_M": 16, "BLOCK_N": 64,
      "BLOCK_K": 64, "DOT_PRECISION": "tf32"}),
    # Its decode path at the default tiles: gate/up GEMV with expert_map, down GEMV.
    ("fused_moe", "_decode_gate_up_kernel",
     {"TOP_K": 8, "HAS_MAP": True, "BLOCK_N": 8, "BLOCK_K": 256}),
    ("fused_moe", "_decode_down_pairs_kernel",
     {"TOP_K": 8, "PAIRS": 8, "HAS_MAP": True, "BLOCK_N": 4, "BLOCK_K": 256}),
    ("fused_moe", "_route_topk_kernel",
     {"TOP_K": 8, "PAIRS": 8, "BLOCK_E": 128, "RENORMALIZE": True}),
    ("decode_attention", "_decode_attention_stage1_kernel",
     {**LLAMA_ATTN, "NUM_Q_HEADS": 32, "QPK": 4, "BLOCK_H": 16, "MAX_Q": 1, "NUM_KV_SPLITS": 16,
      "WIDEN_FP16": False, "SLIDING": False, "FP8_QK": False, "SOFT_CAP": False}),
    ("decode_attention", "_decode_attention_stage1_kernel",
     {**LLAMA_ATTN, "HEAD_DIM": 256, "HEAD_DIM_PADDED": 256, "NUM_Q_HEADS": 16, "QPK": 2,
      "BLOCK_H": 16, "MAX_Q": 1, "NUM_KV_SPLITS": 8, "WIDEN_FP16": False, "SLIDING": True,
      "FP8_QK": False, "SOFT_CAP": True}),
    ("decode_attention", "_decode_attention_stage2_kernel",
     {"NUM_Q_HEADS": 32, "HEAD_DIM": 128, "HEAD_DIM_PADDED": 128, "NUM_KV_SPLITS": 16,
      "MAX_Q": 1}),
    # Verification (speculative decoding, k = 4): 5 tokens x QPK 4 packed into 32 rows,
    # and k = 7 with a window: 8 x 8 = 64 rows.
    ("decode_attention", "_decode_attention_stage1_kernel",
     {**LLAMA_ATTN, "NUM_Q_HEADS": 32, "QPK": 4, "BLOCK_H": 32, "MAX_Q": 5,
      "NUM_KV_SPLITS": 16, "WIDEN_FP16": False, "SLIDING": False, "FP8_QK": False,
      "SOFT_CAP": False}),
    ("decode_attention", "_decode_attention_stage1_kernel",
     {**LLAMA_ATTN, "NUM_Q_HEADS": 64, "QPK": 8, "BLOCK_H": 64, "MAX_Q": 8,
      "NUM_KV_SPLITS": 1, "WIDEN_FP16": False, "SLIDING": True, "FP8_QK": False,
      "SOFT_CAP": True}),
    ("decode_attention", "_decode_attention_stage2_kernel",
     {"NUM_Q_HEADS": 32, "HEAD_DIM": 128, "HEAD_DIM_PADDED": 128, "NUM_KV_SPLITS": 16,
      "MAX_Q": 5}),
    ("reshape_and_cache", "_reshape_and_cache_kernel",
     {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "NUM_KV_HEADS_PADDED": 8,
      "HEAD_DIM_PADDED": 128, "FP8_MAX": 0.0}),
    ("rms_norm", "_rms_norm_kernel", {"HIDDEN_SIZE": 4096, "BLOCK": 4096, "ADD_RESIDUAL": True}),
    ("rotary", "_rotary_kernel",
     {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": 8, "NUM_Q_HEADS_PADDED": 32,
      "NUM_KV_HEADS_PADDED": 8, "HALF": 64, "HALF_PADDED": 64}),
    ("rotary", "_rotary_and_cache_kernel",
     {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": 8, "NUM_Q_HEADS_PADDED": 32,
      "NUM_KV_HEADS_PADDED": 8, "HALF": 64, "HALF_PADDED": 64, "BLOCK_SIZE": 16,
      "FP8_MAX": 0.0, "QK_NORM": False}),
    # Qwen3-30B-A3B: per-head q/k RMSNorm fused in front of the rotation.
    ("rotary", "_rotary_and_cache_kernel",
     {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": 4, "NUM_Q_HEADS_PADDED": 32,
      "NUM_KV_HEADS_PADDED": 4, "HALF": 64, "HALF_PADDED": 64, "BLOCK_SIZE": 16,
      "FP8_MAX": 0.0, "QK_NORM": True}),
    ("activation", "_silu_and_mul_kernel", {"INTERMEDIATE_SIZE": 14336, "BLOCK": 1024}),
    # --quantization fp8 at Llama-3-8B's down_proj shape (K 14336).
    ("fp8_linear", "_per_token_quant_kernel",
     {"K": 14336, "BLOCK": 1024, "FP8_MAX": 448.0, "EPS": 1e-12}),
    ("fp8_linear", "_w8a16_gemm_kernel",
     {"N": 4096, "K": 14336, "K_PER_SPLIT": 1792, "BLOCK_M": 16, "BLOCK_N": 64,
      "BLOCK_K": 128, "HAS_BIAS": False, "DOT_PRECISION": "tf32"}),
    ("fp8_linear", "_split_k_reduce_kernel",
     {"N": 4096, "SPLIT_K": 8, "BLOCK": 1024, "HAS_BIAS": True}),
]
# --kv-cache-dtype fp8: the same kernels over an E4M3 cache (bf16 activations).
FP8_CACHE = {"key_cache_ptr": "*fp8e4nv", "value_cache_ptr": "*fp8e4nv"}
FP8_KERNELS: list[tuple[str, str, dict[str, object]]] = [
    ("reshape_and_cache", "_reshape_and_cache_kernel",
     {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "NUM_KV_HEADS_PADDED": 8,
      "HEAD_DIM_PADDED": 128, "FP8_MAX": 448.0}),
    ("rotary", "_rotary_and_cache_kernel",
     {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": 8, "NUM_Q_HEADS_PADDED": 32,
      "NUM_KV_HEADS_PADDED": 8, "HALF": 64, "HALF_PADDED": 64, "BLOCK_SIZE": 16,
      "FP8_MAX": 448.0, "QK_NORM": False}),
    ("paged_attention", "_paged_attention_kernel",
     {**LLAMA_ATTN, "QPK": 4, "BLOCK_Q": 16, "BLOCK_M": 64, "WIDEN_FP16": True,
      "SLIDING": False, "SOFT_CAP": False}),
    # Decode over an E4M3 cache: widened to fp16 (module docstring), one split (the
    # output written by stage 1) and 16; and a k = 4 verification step.
    ("decode_attention", "_decode_attention_stage1_kernel",
     {**LLAMA_ATTN, "NUM_Q_HEADS": 32, "QPK": 4, "BLOCK_H": 32, "MAX_Q": 5,
      "NUM_KV_SPLITS": 16, "WIDEN_FP16": True, "SLIDING": False, "FP8_QK": False,
      "SOFT_CAP": False}),
    ("decode_attention", "_decode_attention_stage1_kernel",
     {**LLAMA_ATTN, "NUM_Q_HEADS": 32, "QPK": 4, "BLOCK_H": 16, "MAX_Q": 1, "NUM_KV_SPLITS": 1,
      "WIDEN_FP16": True, "SLIDING": False, "FP8_QK": False, "SOFT_CAP": False}),
    ("decode_attention", "_decode_attention_stage1_kernel",
     {**LLAMA_ATTN, "TILE_N": 64, "NUM_Q_HEADS": 32, "QPK": 4, "BLOCK_H": 16, "MAX_Q": 1,
      "NUM_KV_SPLITS": 16, "WIDEN_FP16": True, "SLIDING": False, "FP8_QK": False, "SOFT_CAP": False}),    # DecodeLaunchConfig.fp8_qk: Q.K on the E4M3 tensor cores, only V widened.
    ("decode_attention", "_decode_attention_stage1_kernel",
     {**LLAMA_ATTN, "TILE_N": 64, "NUM_Q_HEADS": 32, "QPK": 4, "BLOCK_H": 16, "MAX_Q": 1,
      "NUM_KV_SPLITS": 16, "WIDEN_FP16": True, "SLIDING": False, "FP8_QK": True,
      "SOFT_CAP": False}),
]
# Pointer arguments that are not activations/caches (those are bf16).
POINTER_TYPES = {
    "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
    "slot_mapping_ptr": "*i64", "positions_ptr": "*i64", "cos_ptr": "*fp32",
    "sin_ptr": "*fp32", "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32",
    "sorted_ids_ptr": "*i64", "block_experts_ptr": "*i64", "topk_weights_ptr": "*fp32",
    "xq_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "weight_ptr": "*fp8e4nv", "weight_scale_ptr": "*fp32",
    "partial_ptr": "*fp32", "topk_ids_ptr": "*i64", "ids_ptr": "*i64",
    "weights_ptr": "*fp32", "expert_map_ptr": "*i32",
}
SCALAR_TYPES = {"num_reqs": "i32", "scale": "fp32", "eps": "fp32", "norm_eps": "fp32", "sliding_window": "i32", "E": "i32",
                "soft_cap": "fp32", "num_pairs": "i32", "N": "i32", "K": "i32", "M": "i32",
                "INTER": "i32"}


def compile_all() -> None:
    """Compile every entry of KERNELS for sm_90 (run with TRITON_INTERPRET unset)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cases = [(k, POINTER_TYPES) for k in KERNELS]
    cases += [(k, {**POINTER_TYPES, **FP8_CACHE}) for k in FP8_KERNELS]
    for (module, name, constexprs), pointer_types in cases:
        fn = getattr(importlib.import_module(f"flowengine.kernels.{module}"), name)
        signature: dict[str, str] = {}
        for arg in fn.arg_names:
            if arg in constexprs:
                signature[arg] = "constexpr"
            elif arg.endswith("_ptr"):
                signature[arg] = pointer_types.get(arg, "*bf16")
            elif "stride" in arg:
                signature[arg] = "i64"
            else:
                signature[arg] = SCALAR_TYPES[arg]
        triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))


def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences Triton 3.9's default-change warning
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import test_kernel_compile_sm90 as t; t.compile_all()"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, f"a kernel does not compile for sm_90:\n{proc.stderr[-6000:]}"
