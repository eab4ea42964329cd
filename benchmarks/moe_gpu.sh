#!/bin/bash
# Issue 15 on the H200 in one call: the fused-MoE GPU tests (decode path included),
# then one MoE layer grouped vs decode variants, Qwen3-30B-A3B decode at batch 1 and 64
# against the roofline of the bytes read, and a profile of the batch-1 step
# (profile_b1.txt); with FAMILIES=1 the ten families against transformers in bf16.
# Usage: [FAMILIES=1] benchmarks/moe_gpu.sh OUT
set -o pipefail
OUT=${1:?OUT folder}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
timeout 60 python3 -m pytest -q -o addopts="" -x tests/gpu/test_fused_moe_gpu.py 2>&1 | tee "$OUT/test_fused_moe_gpu.log" | tail -3
timeout 150 python3 benchmarks/moe_gpu.py --out "$OUT" --skip-tune --skip-hf --decode-compare \
    --decode-batches 1,64 --skip-offline --profile > "$OUT/moe_gpu.log" 2>&1
echo "moe_gpu.py rc=$?"
# The final tables only (the whole log and profile_b1.txt come back in OUT).
sed -n '/^NVIDIA\|^command:/,$p' "$OUT/moe_gpu.log" | grep -v "^decode-compare {" | cut -c1-400
grep -m3 -i "error\|Traceback" "$OUT/moe_gpu.log"
# Families against transformers in bf16 (10 models, ~17 s each serially; -n 5 runs 5 at
# once on the 16 cores, each engine sized by num_kv_blocks, not by GPU memory share).
if [ "${FAMILIES:-0}" = 1 ]; then
    timeout "${FAMILIES_TIMEOUT:-150}" python3 -m pytest -q -o addopts="-ra" -n 5 --tb=short \
        tests/gpu/test_families_gpu.py 2>&1 | tee "$OUT/test_families_gpu.log" | grep -v "^  \|^$" | tail -25
fi
