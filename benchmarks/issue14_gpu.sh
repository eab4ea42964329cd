#!/bin/bash
# Issue 14 on one H200, one call, in order of priority under one deadline (DEADLINE_S,
# default 300 s; a step that would start past it is skipped and says so):
#   bf16    (a, b) gpu_bench.py bf16: batch 1 and 256 x 1k, roofline, and the per-kernel
#           floor from the copy bandwidth and the bf16 GEMM rate measured in the same run
#   fp8kv   (a, b) the same with FP8 weights + FP8 KV (floor at the measured E4M3 rate)
#   tput_*  (c) `flowengine bench throughput` N x 200/200 (N = NUM_PROMPTS, 1000), FP8 + FP8
#           KV and bf16, --max-num-seqs 256 (the concurrency of (d))
#   serve   (d) `flowengine serve` (FP8 + FP8 KV, --async-scheduling, --placement PLACEMENT,
#           default multiproc) driven by
#           `flowengine bench serve` at concurrency 256 (N prompts) and 1 (SERVE_C1_PROMPTS)
#           (executor timers and, with py-spy on the PATH, 3 s of stacks at c256;
#           CLIENT_PROCS=N: c256's requests over N client processes of one command)
#   tput_fp8kv_c1  (d) the offline engine at batch 1 on SERVE_C1_PROMPTS prompts, FP8 + FP8
#           KV: the reference of the served c1 TPOT (ms/token = 1000 / output tok/s)
#   tests   the kernel and FP8 GPU tests (incl. fused rotary + KV write bit for bit;
#           TESTS overrides the files)
#   attn_fp8qk  decode attention alone over an E4M3 cache: K/V widened vs Q.K in E4M3
#   hf      tests/gpu/test_hf_equivalence_gpu.py (Llama and Qwen3)
#   peer    (e) the compiled plain-PyTorch peer, batch 1 and 256
#   fp8kv_qk8  (a, b) FP8 + FP8 KV again with FLOWENGINE_DECODE_FP8_QK=1
# ONLY="bf16 serve ..." runs only the steps named. Llama-3.1-8B shapes, dummy weights (gpu_bench.py --write-config: config + a word-level
# tokenizer of one token per id).
#   benchmarks/issue14_gpu.sh OUT_DIR
# A dry run on the CPU (the engine steps only; the gpu_bench / tests / peer steps need CUDA):
#   MODEL_DIR=tiny_cfg_dir FP8_FLAGS= NUM_PROMPTS=8 SERVE_C1_PROMPTS=2 INPUT_LEN=16 OUTPUT_LEN=8 \
#     ONLY="tput_bf16 serve" benchmarks/issue14_gpu.sh OUT
# MODEL_DIR: a model dir instead of the Llama-3.1-8B config (dummy weights either way);
# FP8_FLAGS: the FP8 flags of the fp8 steps and of the server (default
# "--quantization fp8 --kv-cache-dtype fp8"; empty on a device without FP8).
set -uo pipefail
OUT=${1:?usage: issue14_gpu.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$SECONDS
DEADLINE_S=${DEADLINE_S:-300}
N=${NUM_PROMPTS:-1000}
C1=${SERVE_C1_PROMPTS:-8}
ILEN=${INPUT_LEN:-200}
OLEN=${OUTPUT_LEN:-200}
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=benchmarks/_wait_server.sh
. "$HERE/_wait_server.sh"
fe=(python3 -m flowengine.entrypoints.cli)
# The offline runs with INFO logs (engine ready in N s, graphs captured, stats): a step
# that runs into its limit then says whether start-up or generation took the time.
fe_log=(python3 -c 'import logging, sys; logging.basicConfig(level=logging.INFO,
format="%(asctime)s %(name)s: %(message)s"); from flowengine.entrypoints.cli import main
sys.exit(main())')
# No hub look-ups from transformers on a host that reaches nothing.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
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
if [ -n "${MODEL_DIR:-}" ]; then
    MODEL=$MODEL_DIR
else
    MODEL=$(mktemp -d)
    python3 benchmarks/gpu_bench.py --write-config "$MODEL" > /dev/null
fi
FP8_FLAGS=${FP8_FLAGS---quantization fp8 --kv-cache-dtype fp8}
read -r -a fp8 <<< "$FP8_FLAGS"
step bf16 55 python3 benchmarks/gpu_bench.py --out "$OUT/bf16" --no-profile --steps 32
step fp8kv 50 python3 benchmarks/gpu_bench.py --out "$OUT/fp8kv" --no-profile --steps 32 "${fp8[@]}"
tput=(bench throughput --model "$MODEL" --load-format dummy --dtype bfloat16
      --num-prompts "$N" --input-len "$ILEN" --output-len "$OLEN" --max-num-seqs 256 --max-model-len 1024)
# The first engine of a fresh machine also compiles every Triton kernel it uses (an empty
# cache: on 2026-12-02 the FP8 run, first, ran past 55 s; the bf16 run after it took 42 s,
# 16.7 s of them generating): hence 90 s for the first step.
TAIL=5 step tput_fp8kv 90 "${fe_log[@]}" "${tput[@]}" "${fp8[@]}"
TAIL=5 step tput_bf16 60 "${fe_log[@]}" "${tput[@]}"
serve() {  # (d): one server, concurrency 256 then 1; every client under its own timeout
    local fe=(python3 -m flowengine.entrypoints.cli) port=8765
    # shellcheck disable=SC2086
    FLOWENGINE_LOG_LEVEL=INFO "${fe[@]}" serve "$MODEL" --load-format dummy --dtype bfloat16 $SERVE_FLAGS \
        --max-num-seqs 256 --max-model-len 1024 --async-scheduling --placement "$PLACEMENT" --log-level info \
        --port "$port" > "$OUT/serve_server.log" 2>&1 &
    local pid=$!
    echo "$pid" > "$OUT/serve.pid"
    wait_server "$port" "$pid" 90 || { tail -20 "$OUT/serve_server.log"; kill "$pid"; return 1; }
    echo "server up at t=$((SECONDS - T0))s"
    for c in 256 1; do
        local n=$N; [ "$c" = 1 ] && n=$C1
        echo "-- bench serve: concurrency $c, $n prompts x $ILEN/$OLEN"
        if [ "$c" = 256 ] && command -v py-spy > /dev/null; then  # 3 s of steady serving
            (wait_running "$port" 40 && timeout 20 py-spy record --subprocesses --nonblocking \
                -r 200 -d 3 -f raw -o "$OUT/pyspy_serve.txt" -p "$pid" > /dev/null 2>&1) &
        fi
        # CLIENT_PROCS > 1: one `bench serve` whose client processes share c256's load
        # (one Python process parsing every streamed token limits what it measures)
        local procs=()
        [ "$c" = 256 ] && [ "$CLIENT_PROCS" -gt 1 ] && procs=(--num-client-processes "$CLIENT_PROCS")
        # a client takes ~17 s (H200 host, 2026-12-02) before its first request
        timeout "$((c == 1 ? 45 : 60))" "${fe[@]}" bench serve --port "$port" \
            --tokenizer "$MODEL" --num-prompts "$n" --random-input-len "$ILEN" \
            --random-output-len "$OLEN" --max-concurrency "$c" --ignore-eos --disable-tqdm \
            ${procs[@]+"${procs[@]}"} --result-file "$OUT/serve_c$c.json" > "$OUT/serve_c$c.txt" 2>&1
        echo "exit $?"
        grep -E "Successful|Failed|duration|Output token throughput|Mean TPOT|Median TPOT|Mean TTFT|tokeniz" \
            "$OUT/serve_c$c.txt"
        prefix_hits "$port"  # cumulative: distinct prompts hit ~0%
    done
    stop_server "$pid"
    grep -h "executor timers" "$OUT/serve_server.log" | sed 's/^.*executor timers/executor timers/'
}
export -f serve wait_server wait_running stop_server prefix_hits metrics_line
SERVE_FLAGS=${SERVE_FLAGS-$FP8_FLAGS}
# multiproc: the inproc placement is bound by its one process (issue 12's H200 runs)
PLACEMENT=${PLACEMENT:-multiproc}
CLIENT_PROCS=${CLIENT_PROCS:-1}
export OUT MODEL N C1 T0 SERVE_FLAGS ILEN OLEN PLACEMENT CLIENT_PROCS
TAIL=20 step serve 130 bash -c serve
# (d) at concurrency 1 against the offline engine at batch 1 on the same prompts:
# ms/token = 1000 / output tok/s (prefill included: ~1 token's worth of 200)
TAIL=5 step tput_fp8kv_c1 45 "${fe_log[@]}" "${tput[@]}" "${fp8[@]}" \
    --num-prompts "$C1" --max-num-seqs 1
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
for f in "$OUT"/tput_*.log; do
    [ -f "$f" ] && echo "$(basename "$f" .log): $(grep -hE "^\| flowengine" "$f")"
done
grep -E "Output token throughput|Mean TPOT|concurrency|executor timers" "$OUT/serve.log" 2>/dev/null
grep -hE "passed|failed" "$OUT/tests.log" "$OUT/hf.log" 2>/dev/null | tail -2
grep -hE "^\|" "$OUT/peer.log" 2>/dev/null | tail -4
python3 - "$OUT" <<'PY'  # (c) and (d) against their targets, from the logs above
import json, os, re, sys
out = sys.argv[1]
def tput(name):  # output tok/s of a `bench throughput` log (its table's 5th column)
    try:
        m = re.search(r"^\| flowengine \|[^|]*\|[^|]*\|[^|]*\| *([0-9.]+)", open(f"{out}/{name}.log").read(), re.M)
        return float(m.group(1)) if m else None
    except OSError:
        return None
def served(c):
    try:
        return json.load(open(f"{out}/serve_c{c}.json"))
    except (OSError, ValueError):
        return None
f8, b16, f8c1 = tput("tput_fp8kv"), tput("tput_bf16"), tput("tput_fp8kv_c1")
s256, s1 = served(256), served(1)
fmt = lambda v, f="{:,.0f}": "not run" if v is None else f.format(v)
rows = [("(c) offline FP8 + FP8 KV, output tok/s", fmt(f8), ">= 20,000"),
        ("(c) offline bf16, output tok/s", fmt(b16), ""),
        ("(c) FP8 / bf16", fmt(f8 / b16 if f8 and b16 else None, "{:.2f}x"), ">= 1.6x")]
if s256:
    r = s256["output_throughput"]
    rows.append(("(d) served c256, output tok/s (%d ok, %d failed)" % (s256["completed"], s256["failed"]),
                 fmt(r), "within 10% of (c)"))
    rows.append(("(d) served c256 / offline FP8", fmt(r / f8 if f8 else None, "{:.3f}"), ">= 0.90"))
if s1:
    tp = s1["latency"]["tpot"]["median_ms"]
    rows.append(("(d) served c1, median TPOT ms", fmt(tp, "{:.3f}"), ""))
    off = 1000 / f8c1 if f8c1 else None
    rows.append(("(d) offline FP8 batch 1, ms/token", fmt(off, "{:.3f}"), ""))
    rows.append(("(d) served c1 TPOT / offline batch 1", fmt(tp / off if off else None, "{:.3f}"), "<= 1.10"))
print("| figure | measured | target |\n|---|---:|---|")
for r in rows:
    print("| %s | %s | %s |" % r)
PY
