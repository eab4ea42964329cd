#!/usr/bin/env bash
# FP8 on one Hopper GPU (issue 14, points 1-2): the FP8 tests, then gpu_bench.py's
# decode steps at Llama-3.1-8B shapes (dummy weights) for bf16, FP8 weights, and FP8
# weights + FP8 KV cache, one after the other in the same run; then offline throughput
# (`flowengine bench throughput`, 1000 x 200/200) for bf16 and FP8 weights + KV.
#
#   benchmarks/fp8_gpu.sh OUT_DIR
#
# Tables land in OUT_DIR/summary.md (each with its command); logs beside it.
set -uo pipefail
out=$1
mkdir -p "$out"
say() { echo "$*" | tee -a "$out/summary.md"; }
say "## FP8 tests ($(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader))"
python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fp8_gpu.py tests/quantization \
  tests/kernels/test_kernel_fp8_kv_cache.py tests/kernels/test_kernel_fp8_linear.py \
  tests/kernels/test_kernel_compile_sm90.py tests/kernels/test_kernel_reshape_and_cache.py \
  tests/kernels/test_kernel_paged_attention.py tests/kernels/test_kernel_decode_attention.py \
  >"$out/tests.log" 2>&1
grep -E "greedy tokens equal|passed|failed|Error" "$out/tests.log" | tail -12 | tee -a "$out/summary.md"
if [ "${SKIP_BENCH:-0}" = 1 ]; then exit 0; fi
for cfg in "" "--quantization fp8" "--quantization fp8 --kv-cache-dtype fp8"; do
  say ""
  say "### gpu_bench.py ${cfg:-bf16}"
  # shellcheck disable=SC2086
  python3 benchmarks/gpu_bench.py --out "$out/bench" --no-profile --steps 64 $cfg \
    >"$out/bench_${cfg// /_}.log" 2>&1
  grep -E "^\||^command|^GPU" "$out/bench_${cfg// /_}.log" | tee -a "$out/summary.md"
done
if [ "${SKIP_THROUGHPUT:-0}" = 1 ]; then exit 0; fi
model=$(mktemp -d)
python3 benchmarks/gpu_bench.py --write-config "$model" >/dev/null
for cfg in "" "--quantization fp8 --kv-cache-dtype fp8"; do
  say ""
  say "### flowengine bench throughput 1000 x 200/200 ${cfg:-bf16}"
  # shellcheck disable=SC2086
  python3 -m flowengine.entrypoints.cli bench throughput --model "$model" --load-format dummy \
    --dtype bfloat16 --num-prompts 1000 --input-len 200 --output-len 200 \
    --max-num-seqs 512 --max-model-len 1024 $cfg >"$out/tput_${cfg// /_}.log" 2>&1
  tail -6 "$out/tput_${cfg// /_}.log" | tee -a "$out/summary.md"
done
