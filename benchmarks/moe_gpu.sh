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
timeout 100 python3 -m pytest -q -o addopts="" tests/gpu/test_fused_moe_gpu.py 2>&1 | tee "$OUT/test_fused_moe_gpu.log" | tail -3
timeout 150 python3 benchmarks/moe_gpu.py --out "$OUT" --skip-tune --skip-hf --decode-compare \
    --decode-batches 1,64 --skip-offline --profile > "$OUT/moe_gpu.log" 2>&1
echo "moe_gpu.py rc=$?"
# The final tables only (the whole log and profile_b1.txt come back in OUT).
sed -n '/^NVIDIA\|^command:/,$p' "$OUT/moe_gpu.log" | grep -v "^decode-compare {" | cut -c1-400
grep -m3 -i "error\|Traceback" "$OUT/moe_gpu.log"
# Families against transformers in bf16 (10 models, ~17 s each serially; -n 5 runs 5 at
# once on the 16 cores, each engine sized by num_kv_blocks, not by GPU memory share).
if [ "${FAMILIES:-0}" = 1 ]; then
    # Session 26's phi4 failure: the reference's smallest greedy margin at the old
    # embedding scale 0.5 (the test now uses 1.0; it requires >= 1.0 std).
    (cd tests/gpu && timeout 60 python3 -c "
import random, tempfile, torch, gpu_models as g
p = tempfile.mkdtemp(); g.save_model('phi4', p, 1234, device='cuda', embed_std=0.5)
hf = g.AutoModelForCausalLM.from_pretrained(p, dtype=torch.bfloat16).cuda().eval()
rng = random.Random(1234); t = lambda n: [rng.randrange(g.VOCAB_SIZE) for _ in range(n)]
pre = t(64); ps = [pre + t(9), pre + t(40), *(t(n) for n in (5, 300, 17, 128, 77, 200))]
print('phi4 at embed_std 0.5: smallest margin per prompt',
      [round(min(g.hf_greedy(hf, q, 16).margins), 3) for q in ps])" 2>&1 | tail -2)
    timeout "${FAMILIES_TIMEOUT:-150}" python3 -m pytest -q -o addopts="-ra" -n 5 --tb=short \
        tests/gpu/test_families_gpu.py 2>&1 | tee "$OUT/test_families_gpu.log" | grep -v "^  \|^$" | tail -25
fi
