#!/usr/bin/env bash
# CPU time per output token of each `flowengine serve` process (issue 12): the HTTP
# frontend (process 0, and more with --api-server-count), the executor and the engine,
# on a tiny random-weight model so the frontend's share is what a small model on a GPU
# leaves it. One served run per call; alternate calls to compare flags.
#
#   benchmarks/frontend_cpu.sh MODEL_DIR LABEL [serve flags...]
#
# MODEL_DIR: a config.json + tokenizer folder (no weights; --load-format dummy), e.g. a
# 2-layer, 64-wide Llama config with SmolLM2's tokenizer. Env: N (prompts, 1024), C
# (concurrency, 128), OL (output tokens, 64), PYSPY=SECONDS (py-spy of process 0 into
# /tmp/frontend_cpu_LABEL.raw). Prints: LABEL, output tok/s, then pid:us-per-token for
# the server process and each child (process 0 first), and the 1-minute load average.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=benchmarks/_wait_server.sh
. "$HERE/_wait_server.sh"
model=$1 label=$2; shift 2
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fe=(python3 -m flowengine.entrypoints.cli)
"${fe[@]}" serve "$model" --load-format dummy --dtype float32 --placement multiproc \
  --async-scheduling --max-num-seqs 256 --max-model-len 1024 --port "$port" \
  --disable-log-requests --log-level warning "$@" > "/tmp/frontend_cpu_$label.log" 2>&1 &
sp=$!
wait_server "$port" "$sp" 120 || { tail -20 "/tmp/frontend_cpu_$label.log"; kill "$sp"; exit 1; }
bench=("${fe[@]}" bench serve --port "$port" --tokenizer "$model" --dataset-name random
       --random-input-len 128 --ignore-eos --disable-tqdm)
"${bench[@]}" --random-output-len 16 --num-prompts 32 --max-concurrency 8 --seed 9 > /dev/null 2>&1  # warm-up
c0=$(cpu_s "$sp")
ps_pid=
if [ -n "${PYSPY:-}" ]; then
  py-spy record -r 500 -f raw -o "/tmp/frontend_cpu_$label.raw" -p "$sp" -d "$PYSPY" > /dev/null 2>&1 &
  ps_pid=$!
fi
"${bench[@]}" --random-output-len "${OL:-64}" --num-prompts "${N:-1024}" --max-concurrency "${C:-128}" \
  --seed 0 --result-file "/tmp/frontend_cpu_$label.json" > "/tmp/frontend_cpu_client_$label.txt" 2>&1
c1=$(cpu_s "$sp")
[ -n "$ps_pid" ] && wait "$ps_pid"
python3 - "$c0" "$c1" "$label" <<'PY'
import json, sys
before, after, label = sys.argv[1:]
r = json.load(open(f"/tmp/frontend_cpu_{label}.json"))
tokens = r["total_output"]
a = dict(x.split(":") for x in before.split())
b = dict(x.split(":") for x in after.split())
per = " ".join(f"{p}:{(float(b[p]) - float(a.get(p, 0))) * 1e6 / tokens:.1f}" for p in b)
print(f"{label:12s} out_tok/s={r['output_throughput']:8.1f} cpu_us_per_token {per} "
      f"load={open('/proc/loadavg').read().split()[0]}")
PY
kill -INT "$sp"; wait "$sp" 2>/dev/null
