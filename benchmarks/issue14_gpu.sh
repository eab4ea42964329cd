#!/bin/bash
# Issue 14 on one H200, one call, in order of priority under one deadline (DEADLINE_S,
# default 300 s; a step that would start past it is skipped and says so):
#   bf16    (a, b) gpu_bench.py bf16: batch 1 and 256 x 1k, roofline, and the per-kernel
#           floor from the copy bandwidth and the bf16 GEMM rate measured in the same run
#   fp8kv   (a, b) the same with FP8 weights + FP8 KV (floor at the measured E4M3 rate)
#   tput_*  (c) `flowengine bench throughput` N x 200/200 (N = NUM_PROMPTS, 1000), FP8 + FP8
#           KV and bf16, --max-num-seqs 256 (the concurrency of (d))
#   serve   (d) `flowengine serve` (FP8 + FP8 KV, --async-scheduling) driven by
#           `flowengine bench serve` at concurrency 256 (N prompts) and 1 (SERVE_C1_PROMPTS)
#   tests   the kernel and FP8 GPU tests (incl. fused rotary + KV write bit for bit;
#           TESTS overrides the files)
#   attn_fp8qk  decode attention alone over an E4M3 cache: K/V widened vs Q.K in E4M3
#   hf      tests/gpu/test_hf_equivalence_gpu.py (Llama and Qwen3)
#   peer    (e) the compiled plain-PyTorch peer, batch 1 and 256
#   fp8kv_qk8  (a, b) FP8 + FP8 KV again with FLOWENGINE_DECODE_FP8_QK=1
# ONLY="bf16 serve ..." runs only the steps named. Llama-3.1-8B shapes, dummy weights (gpu_bench.py --write-config: config + a word-level
# tokenizer of one token per id).
#   benchmarks/issue14_gpu.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: issue14_gpu.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$SECONDS
DEADLINE_S=${DEADLINE_S:-300}
N=${NUM_PROMPTS:-1000}
C1=${SERVE_C1_PROMPTS:-8}
fe=(python3 -m flowengine.entrypoints.cli)
step() {  # step NAME TIMEOUT_S CMD...: run, log to OUT/NAME.log, keep going on failure
    local name=$1 limit=$2; shift 2
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
    local left=$((DEADLINE_S - (SECONDS - T0)))
    if [ "$left" -lt 15 ]; then echo "== $name: SKIPPED (deadline, ${left}s left)"; return 1; fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit ${limit}s, t=$((SECONDS - T0))s): $*"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? (t=$((SECONDS - T0))s)"
    tail -n "${TAIL:-12}" "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
MODEL=$(mktemp -d)
python3 benchmarks/gpu_bench.py --write-config "$MODEL" > /dev/null
fp8=(--quantization fp8 --kv-cache-dtype fp8)
step bf16 55 python3 benchmarks/gpu_bench.py --out "$OUT/bf16" --no-profile --steps 32
step fp8kv 50 python3 benchmarks/gpu_bench.py --out "$OUT/fp8kv" --no-profile --steps 32 "${fp8[@]}"
tput=(bench throughput --model "$MODEL" --load-format dummy --dtype bfloat16
      --num-prompts "$N" --input-len 200 --output-len 200 --max-num-seqs 256 --max-model-len 1024)
TAIL=5 step tput_fp8kv 55 "${fe[@]}" "${tput[@]}" "${fp8[@]}"
TAIL=5 step tput_bf16 55 "${fe[@]}" "${tput[@]}"
serve() {  # (d): one server, concurrency 256 then 1; every client under its own timeout
    local fe=(python3 -m flowengine.entrypoints.cli) port=8765
    # shellcheck disable=SC2086
    "${fe[@]}" serve "$MODEL" --load-format dummy --dtype bfloat16 $SERVE_FLAGS --max-num-seqs 256 --max-model-len 1024 --async-scheduling \
        --port "$port" > "$OUT/serve_server.log" 2>&1 &
    local pid=$!
    echo "$pid" > "$OUT/serve.pid"
    python3 - "$port" "$pid" <<'PY' || { tail -20 "$OUT/serve_server.log"; kill "$pid"; return 1; }
import os, sys, time, urllib.request
for _ in range(360):
    try:
        os.kill(int(sys.argv[2]), 0)
    except OSError:
        sys.exit("server exited")
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1)
        sys.exit(0)
    except Exception:
        time.sleep(0.25)
sys.exit("server did not come up")
PY
    echo "server up at t=$((SECONDS - T0))s"
    for c in 256 1; do
        local n=$N; [ "$c" = 1 ] && n=$C1
        echo "-- bench serve: concurrency $c, $n prompts x 200/200"
        timeout "$((c == 1 ? 25 : 50))" "${fe[@]}" bench serve --port "$port" \
            --tokenizer "$MODEL" --num-prompts "$n" --random-input-len 200 \
            --random-output-len 200 --max-concurrency "$c" --ignore-eos --disable-tqdm \
            --result-file "$OUT/serve_c$c.json" > "$OUT/serve_c$c.txt" 2>&1
        echo "exit $?"
        grep -E "Successful|Failed|duration|Output token throughput|Mean TPOT|Median TPOT|Mean TTFT|tokeniz" \
            "$OUT/serve_c$c.txt"
    done
    kill -INT "$pid"; wait "$pid"
}
export -f serve
SERVE_FLAGS=${SERVE_FLAGS---quantization fp8 --kv-cache-dtype fp8}
export OUT MODEL N C1 T0 SERVE_FLAGS
TAIL=20 step serve 90 bash -c serve
if [ -f "$OUT/serve.pid" ] && kill -0 "$(cat "$OUT/serve.pid")" 2>/dev/null; then
    kill "$(cat "$OUT/serve.pid")"; sleep 3
fi
TESTS=${TESTS:-tests/gpu/test_kernels_gpu.py tests/gpu/test_fp8_gpu.py \
tests/kernels/test_kernel_fp8_kv_cache.py tests/kernels/test_kernel_decode_attention.py \
tests/kernels/test_kernel_rotary.py}
# shellcheck disable=SC2086
TAIL=8 step tests 75 python3 -m pytest -q -rfE --tb=line -p no:cacheprovider $TESTS
TAIL=25 step attn_fp8qk 40 python3 benchmarks/decode_attention_bench.py --fp8-qk --out "$OUT/attn"
TAIL=4 step hf 50 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_hf_equivalence_gpu.py
step peer 60 python3 benchmarks/compiled_peer.py --out "$OUT/peer"
FLOWENGINE_DECODE_FP8_QK=1 step fp8kv_qk8 50 python3 benchmarks/gpu_bench.py \
    --out "$OUT/fp8kv_qk8" --no-profile --steps 32 "${fp8[@]}"
echo "== summary (t=$((SECONDS - T0))s)"
grep -hE "^\| (a|b)\.|^GPU" "$OUT/bf16.log" "$OUT/fp8kv.log" "$OUT/fp8kv_qk8.log" 2>/dev/null
grep -hE "^\| flowengine|^\|.*tok" "$OUT"/tput_*.log 2>/dev/null | head -4
grep -E "Output token throughput|Mean TPOT|concurrency" "$OUT/serve.log" 2>/dev/null
grep -hE "passed|failed" "$OUT/tests.log" "$OUT/hf.log" 2>/dev/null | tail -2
grep -hE "^\|" "$OUT/peer.log" 2>/dev/null | tail -4
