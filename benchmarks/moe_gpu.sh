#!/bin/bash
# Issue 15 on the H200 in one call: the fused-MoE GPU tests (decode path included),
# then one MoE layer grouped vs decode variants and Qwen3-30B-A3B decode at batch 1
# and 64 against the roofline of the bytes read. Usage: benchmarks/moe_gpu.sh OUT
set -o pipefail
OUT=${1:?OUT folder}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
timeout 75 python3 -m pytest -q -o addopts="" -x tests/gpu/test_fused_moe_gpu.py 2>&1 | tee "$OUT/test_fused_moe_gpu.log" | tail -5
timeout 150 python3 benchmarks/moe_gpu.py --out "$OUT" --skip-tune --skip-hf --decode-compare \
    --decode-batches 1,64 --skip-offline 2>&1 | tee "$OUT/moe_gpu.log" | grep -v "^decode-compare {"
# Families against transformers in bf16 (10 models, ~17 s each serially; -n 4 runs 4 at
# once on the 16 cores, each engine sized by num_kv_blocks, not by GPU memory share).
if [ "${FAMILIES:-0}" = 1 ]; then
    timeout 300 python3 -m pytest -q -o addopts="" -n 4 tests/gpu/test_families_gpu.py 2>&1 | tee "$OUT/test_families_gpu.log" | tail -8
fi
