#!/usr/bin/env bash
# The served path on one GPU (issue 12): `flowengine serve` driven by `flowengine bench
# serve` at concurrency 256 (128 in / 128 out) against `flowengine bench throughput` on
# the same random-weight SmolLM2-shaped model in the same run, plus the device step
# alone (benchmarks/gpu_bench.py) to split a served step into device and host time.
#
#   benchmarks/served_gpu.sh MODEL_DIR OUT_DIR
#
# MODEL_DIR holds SmolLM2-135M-Instruct's config.json and tokenizer files only (no
# weights: load_format dummy). The tables also land in OUT_DIR/summary.md, the device
# figures in OUT_DIR/gpu_bench.json; server logs stay in /tmp (tailed on failure). Host time per
# request per step = (served TPOT - device step) / 256: with the overlap on, host work
# that fits under the device step costs nothing, so this is the part that does not.
set -uo pipefail
model=$1
out=$2
mkdir -p "$out"
fe=(python3 -m flowengine.entrypoints.cli)
n=${NUM_PROMPTS:-1024}  # smaller for a dry run on the CPU
conc=${CONCURRENCY:-256}
dtype=${DTYPE:-bfloat16}
common=(--load-format dummy --dtype "$dtype" --max-num-seqs "$conc" --max-model-len 2048)

echo "== device step alone (CUDA graph replay), engine loops 1 and 2 in flight" \
  | tee -a "$out/summary.md"
timeout 240 python3 benchmarks/gpu_bench.py --model "$model" --context 128 --batch 256 \
  --max-model-len 2048 --steps 64 --no-profile --out "$out" 2>&1 \
  | tail -8 | tee -a "$out/summary.md"

echo "== offline: flowengine bench throughput" | tee -a "$out/summary.md"
timeout 240 "${fe[@]}" bench throughput --model "$model" "${common[@]}" --num-prompts "$n" \
  --input-len 128 --output-len 128 2>&1 | tail -6 | tee -a "$out/summary.md"

serve_once() {  # $1: label, rest: extra serve flags
  local label=$1; shift
  local port=$((8700 + RANDOM % 200))
  "${fe[@]}" serve "$model" "${common[@]}" --port "$port" "$@" > "/tmp/serve_$label.log" 2>&1 &
  local pid=$!
  python3 - "$port" <<'EOF'
import sys, time, urllib.request
for _ in range(150):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1)
        sys.exit(0)
    except Exception:
        time.sleep(0.2)
sys.exit("server did not come up")
EOF
  if [ $? -ne 0 ]; then tail -20 "/tmp/serve_$label.log"; kill "$pid"; return 1; fi
  echo "== served ($label): flowengine bench serve, concurrency $conc" | tee -a "$out/summary.md"
  timeout 240 "${fe[@]}" bench serve --port "$port" --tokenizer "$model" --num-prompts "$n" \
    --random-input-len 128 --random-output-len 128 --max-concurrency "$conc" --ignore-eos \
    --disable-tqdm 2>&1 | tail -32 | tee -a "$out/summary.md"
  kill -INT "$pid"; wait "$pid"
}
serve_once inproc_async --async-scheduling
serve_once multiproc_async --async-scheduling --placement multiproc
serve_once inproc_sync
