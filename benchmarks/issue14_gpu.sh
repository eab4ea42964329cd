#!/bin/bash
# Issue 14 items 3-4 on one H200, one call: the kernel tests, then (a, b) bf16 with the
# kernel profile and FP8 weights + FP8 KV (gpu_bench.py), HF equivalence of the model
# (fused rotary + KV write, decode kernel), and (e) the compiled plain-PyTorch peer.
#   benchmarks/issue14_gpu.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: issue14_gpu.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() {  # step NAME TIMEOUT_S CMD...: run, log to OUT/NAME.log, keep going on failure
    local name=$1 limit=$2; shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? ($(date +%T))"
    tail -n 12 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
step tests 60 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_kernels_gpu.py \
    tests/kernels/test_triton_backend.py tests/kernels/test_kernel_rotary.py
step bf16 75 python3 benchmarks/gpu_bench.py --out "$OUT/bf16" --no-profile --steps 64 \
    --kernel-profile
step fp8kv 65 python3 benchmarks/gpu_bench.py --out "$OUT/fp8kv" --no-profile --steps 64 \
    --quantization fp8 --kv-cache-dtype fp8
step hf 50 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_hf_equivalence_gpu.py
step peer 60 python3 benchmarks/compiled_peer.py --out "$OUT/peer"
