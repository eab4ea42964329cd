#!/usr/bin/env bash
# The served path on one GPU (issue 12): `flowengine serve` driven by `flowengine bench
# serve` at concurrency 256 (128 in / 128 out) against `flowengine bench throughput` on
# the same random-weight SmolLM2-shaped model in the same run, plus the device step
# alone (benchmarks/gpu_bench.py) to split a served step into device and host time.
#
#   benchmarks/served_gpu.sh MODEL_DIR OUT_DIR
#
# MODEL_DIR holds SmolLM2-135M-Instruct's config.json and tokenizer files only (no
# weights: load_format dummy). The tables land in OUT_DIR/summary.md, the device
# figures in OUT_DIR/gpu_bench.json; server logs stay in /tmp (tailed on failure).
# Host time per request per step = (executor wall per step - device time per step) / rows
# (the run's own device time with the timers, else the device step alone).
#
# A device call from a fresh checkout (sessions 35-37): in the repo root here,
#   ../shared/tools/device-wheels starlette xgrammar llguidance jsonschema \
#     jsonschema-specifications referencing rpds-py attrs py-spy apache-tvm-ffi pydantic \
#     pydantic-core annotated-types typing-inspection
#   mkdir -p .carry/smol && echo /.carry/ >> .git/info/exclude
#   cp ~/.cache/flowengine/models/SmolLM2-135M-Instruct/{config.json,tokenizer*.json} .carry/smol/
# (the default model's converted folder, made by a first `flowengine serve`), then a
# call with carry [".carry", ".whl"] whose command starts with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
#   python3 -m pip install -q --no-deps --no-build-isolation -e .
# and runs this script with OUT_DIR under $OUT. Only 8 files come back from $OUT: copy
# summary.md and the py-spy files you want to its top and remove the rest.
#
# Each served run also reports the CPU seconds of the client and of every server
# process (from /proc), to tell a server-bound run from a client-bound one, and, with
# py-spy on the PATH, records the server's stacks (OUT_DIR/pyspy_LABEL.txt, collapsed),
# and the executor actor's own step timers (`ExecutorActor.timers()`, logged at shutdown:
# wall per step between launches, host time launching/resolving, share of steps whose
# tokens were waited for; the server runs with FLOWENGINE_DEVICE_TIMERS=1, so also the
# device's own time per step in the run and its idle gap before a step, whose share per
# request is the host time the device waited for), the server's own TTFT split (queue,
# prefill, TTFT means from /metrics, against each client's mean TTFT) and, with --api-server-count, how many
# requests each process served. SERVE_RUNS picks the served configurations (labels below).
# LLAMA8B_DIR (a dir from `benchmarks/gpu_bench.py --write-config DIR`): batch-1 TPOT
# through the server against the offline engine's ms/token on Llama-3.1-8B shapes.
# SKIP_DEVICE=1 skips the device step and the offline run; SKIP_DEVICE_STEP=1 the device
# step only (DEVICE_STEP_US then gives the table an earlier run's device step, us).
# A dry run on the CPU (a tiny config dir; the device-step run needs CUDA and fails):
#   NUM_PROMPTS=8 CONCURRENCY=4 DTYPE=float32 SERVE_RUNS="inproc_async multiproc_async" \
#     benchmarks/served_gpu.sh TINY_DIR OUT
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=benchmarks/_wait_server.sh
. "$HERE/_wait_server.sh"
model=$1
out=$2
mkdir -p "$out"
fe=(python3 -m flowengine.entrypoints.cli)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # no hub look-ups on a host that reaches nothing
n=${NUM_PROMPTS:-1024}  # smaller for a dry run on the CPU
T=${STEP_TIMEOUT:-200}  # seconds for each process run (offline, a client, a server to come up)
conc=${CONCURRENCY:-256}
dtype=${DTYPE:-bfloat16}
common=(--load-format dummy --dtype "$dtype" --max-num-seqs "$conc" --max-model-len 2048)
say() { echo "$*" | tee -a "$out/summary.md"; }


device_step() {  # the device step alone (run after the served runs: DEVICE_STEP_LAST=1)
  say "== device step alone (CUDA graph replay), engine loops 1 and 2 in flight"
  timeout "$T" python3 benchmarks/gpu_bench.py --model "$model" --context 128 --batch "$conc" \
    --max-model-len 2048 --steps 64 --no-profile --out "$out" > "$out/gpu_bench.log" 2>&1
  tail -8 "$out/gpu_bench.log" | tee -a "$out/summary.md"
}
if [ -z "${SKIP_DEVICE:-}" ]; then
  [ -z "${DEVICE_STEP_LAST:-}${SKIP_DEVICE_STEP:-}" ] && device_step
  say "== offline: flowengine bench throughput"
  timeout "$T" "${fe[@]}" bench throughput --model "$model" "${common[@]}" --num-prompts "$n" \
    --input-len 128 --output-len 128 > "$out/offline.txt" 2>&1
  tail -6 "$out/offline.txt" | tee -a "$out/summary.md"
fi

serve_once() {  # $1: label, $2: client commands, $3: client processes of one command, rest: serve flags
  local label=$1 clients=$2 procs=$3; shift 3
  local port=$((8700 + RANDOM % 200))
  FLOWENGINE_DEVICE_TIMERS=1 FLOWENGINE_LOG_LEVEL=INFO "${fe[@]}" serve "$model" "${common[@]}" --port "$port" \
    --log-level info "$@" > "/tmp/serve_$label.log" 2>&1 &
  local pid=$!
  wait_server "$port" "$pid" "$T"
  if [ $? -ne 0 ]; then tail -20 "/tmp/serve_$label.log"; kill "$pid"; return 1; fi
  say "== served ($label, flags: $*): $clients client command(s) x $procs process(es), concurrency $conc in all"
  say "server CPU s before (pid:s): $(cpu_s "$pid")"
  if command -v py-spy > /dev/null; then
    (wait_running "$port" 75
     timeout 20 py-spy record --subprocesses --nonblocking -r 200 -d 3 -f raw \
       -o "$out/pyspy_$label.txt" -p "$pid" > /dev/null 2>&1) &
  fi
  local t0=$SECONDS pids=()
  if [ "$procs" -gt 1 ]; then  # one `bench serve` whose N client processes share the load
    clients=1
    ( TIMEFORMAT="client (coordinator) CPU: user %U s, sys %S s, wall %R s"
      time timeout "$T" "${fe[@]}" bench serve --port "$port" --tokenizer "$model" \
        --num-prompts "$n" --random-input-len 128 --random-output-len 128 \
        --max-concurrency "$conc" --ignore-eos --disable-tqdm --seed 1 \
        --num-client-processes "$procs" \
        --result-file "$out/client_${label}_1.json" > "/tmp/client_${label}_1.txt" 2>&1 ) 2>> "$out/summary.md" &
    pids+=($!)
  fi
  for i in $(seq "$clients"); do
    [ "$procs" -gt 1 ] && break
    ( TIMEFORMAT="client $i CPU: user %U s, sys %S s, wall %R s"
      time timeout "$T" "${fe[@]}" bench serve --port "$port" --tokenizer "$model" \
        --num-prompts $((n / clients)) --random-input-len 128 --random-output-len 128 \
        --max-concurrency $((conc / clients)) --ignore-eos --disable-tqdm --seed "$i" \
        --result-file "$out/client_${label}_$i.json" > "/tmp/client_${label}_$i.txt" 2>&1 ) 2>> "$out/summary.md" &
    pids+=($!)
  done
  wait "${pids[@]}"
  say "server CPU s after (pid:s): $(cpu_s "$pid"); clients' wall $((SECONDS - t0)) s"
  say "$(prefix_hits "$port")"
  say "$(ttft_split "$port")"
  # Which process served how many (each request's log line; process i > 0 prefixes it).
  say "requests per API server process: $(grep -E 'openai.requests: ' "/tmp/serve_$label.log" \
    | sed -E 's/^[0-9-]+ [0-9:,]+ (api_server[0-9]+ )?.*/\1/; s/^$/process0/' | sort | uniq -c \
    | tr -s ' \n' ' ')"
  for i in $(seq "$clients"); do
    grep -E "Mean TTFT" "/tmp/client_${label}_$i.txt" | tee -a "$out/summary.md"
  done
  for i in $(seq "$clients"); do
    grep -E "Successful|Failed|duration|Output token throughput|Mean TPOT|Median TPOT" \
      "/tmp/client_${label}_$i.txt" | tee -a "$out/summary.md"
  done
  stop_server "$pid"
  grep -h "executor timers" "/tmp/serve_$label.log" | sed 's/^.*executor timers/executor timers/' \
    | tee -a "$out/summary.md"
  cp "/tmp/serve_$label.log" "$out/" 2>/dev/null
}
# A label is a configuration, with _Nclients for N `bench serve` commands sharing the load
# (each reports its own throughput) or _Nprocs for one command with
# --num-client-processes N (one coordinated figure):
# default (no flags: the placement "auto" picks multiproc on CUDA), inproc_async,
# multiproc_async, multiproc_sync, ascN (the defaults with --api-server-count N), siN
# (with --stream-interval N), and both joined by "-"; e.g.
# SERVE_RUNS="default_4clients asc4_4clients si8_4clients asc4-si8_4clients inproc_async".
runs=${SERVE_RUNS:-default_4clients inproc_async_4clients multiproc_async_4clients multiproc_sync}
for r in $runs; do
  base=$r clients=1 procs=1
  if [[ $r =~ ^(.*)_([0-9]+)clients$ ]]; then base=${BASH_REMATCH[1]} clients=${BASH_REMATCH[2]}; fi
  if [[ $r =~ ^(.*)_([0-9]+)procs$ ]]; then base=${BASH_REMATCH[1]} procs=${BASH_REMATCH[2]}; fi
  case $base in
    default) flags=() ;;
    inproc_async) flags=(--async-scheduling --placement inproc) ;;
    multiproc_async) flags=(--async-scheduling --placement multiproc) ;;
    multiproc_sync) flags=(--placement multiproc) ;;
    asc[0-9]*|si[0-9]*)  # the defaults with --api-server-count N and/or --stream-interval N
      flags=()
      for part in ${base//-/ }; do
        case $part in
          asc[0-9]*) flags+=(--api-server-count "${part#asc}") ;;
          si[0-9]*) flags+=(--stream-interval "${part#si}") ;;
          *) flags=(bad) ;;
        esac
      done
      [ "${flags[0]:-}" = bad ] && { say "unknown run $r (skipped)"; continue; } ;;
    *) say "unknown run $r (skipped)"; continue ;;
  esac
  serve_once "$r" "$clients" "$procs" "${flags[@]}"
done

[ -z "${SKIP_DEVICE:-}${SKIP_DEVICE_STEP:-}" ] && [ -n "${DEVICE_STEP_LAST:-}" ] && device_step

if [ -n "${LLAMA8B_DIR:-}" ]; then  # batch 1, Llama-3.1-8B shapes: served TPOT vs offline
  model=$LLAMA8B_DIR n=${NUM_PROMPTS_8B:-6} conc=1
  common=(--load-format dummy --dtype "$dtype" --max-num-seqs 1 --max-model-len 2048)
  say "== Llama-3.1-8B shapes, batch 1: offline (ms/token = 1000 / output tok/s)"
  timeout "$T" "${fe[@]}" bench throughput --model "$model" "${common[@]}" --num-prompts "$n" \
    --input-len 128 --output-len 128 > "$out/offline_llama8b.txt" 2>&1
  tail -4 "$out/offline_llama8b.txt" | tee -a "$out/summary.md"
  serve_once llama8b_batch1 1 1 --async-scheduling
fi

# The figures against issue 12's targets, from the files above: served / offline output
# tok/s, host time per request per step = (executor wall per step - device time per step)
# / mean rows per step (the run's own device time when the timers measured it, else the
# device step alone), and (Llama-3.1-8B shapes) served batch-1 TPOT / offline ms per token.
python3 - "$out" <<'EOF' | tee -a "$out/summary.md"
import glob, json, os, re, sys
out = sys.argv[1]
def offline(name):
    try:
        m = re.search(r"^\| flowengine \|[^|]*\|[^|]*\|[^|]*\| *([0-9.]+)", open(f"{out}/{name}").read(), re.M)
        return float(m.group(1)) if m else None
    except OSError:
        return None
dev = None
try:
    r = json.load(open(f"{out}/gpu_bench.json"))["results"]
    dev = r[max(r, key=lambda k: int(k[5:]))]["device_ms"] * 1000  # the largest batch's step, us
except (OSError, ValueError, KeyError):
    pass
dev_src = "gpu_bench, CUDA graph replay"
if dev is None and os.environ.get("DEVICE_STEP_US"):  # a figure from an earlier run
    dev, dev_src = float(os.environ["DEVICE_STEP_US"]), "DEVICE_STEP_US, not measured in this run"
off, off8 = offline("offline.txt"), offline("offline_llama8b.txt")
labels = []  # in the order they ran
for p in sorted(glob.glob(f"{out}/client_*.json"), key=os.path.getmtime):
    lab = os.path.basename(p)[7:].rsplit("_", 1)[0]
    labels += [lab] if lab not in labels else []
print("\n| run | output tok/s | / offline | median TPOT ms | executor wall us/step | mean rows"
      " | host us / request / step | waited share | device us/step in the run | device gap"
      " us/step | gap us / request / step |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
print(f"| offline `bench throughput` | {off or 'not run'} | | | | | | | | | |")
if dev:
    print(f"| device step alone ({dev_src}) | | | | {dev:.0f} | | | | | | |")
for lab in labels:
    res = [json.load(open(p)) for p in sorted(glob.glob(f"{out}/client_{lab}_*.json"))
           if re.fullmatch(rf"client_{lab}_\d+\.json", os.path.basename(p))]
    tps = sum(r["output_throughput"] for r in res)
    tpot = max(r["latency"]["tpot"]["median_ms"] for r in res)
    tm = {}
    try:
        line = [ln for ln in open(f"{out}/serve_{lab}.log") if "executor timers" in ln][-1]
        tm = dict(kv.split("=") for kv in line.split("executor timers:")[1].split())
    except (OSError, IndexError, ValueError):
        pass
    wall, rows = float(tm.get("wall_us_per_step", "nan")), float(tm.get("mean_rows", "nan"))
    big = "llama8b" not in lab
    ratio = f"{tps / off:.3f}" if off and big else ""
    # The device's own time per step in this run (FLOWENGINE_DEVICE_TIMERS) and its idle
    # gap before a step: gap / rows is the host time the device waited for, per request.
    dev_run, gap = tm.get("device_us_per_step", ""), tm.get("gap_us_per_step", "")
    # host = (wall - device) / rows, with the run's own device time when it was measured
    # (a served step carries prefill chunks; the step alone is decode only), else `dev`.
    dev_step = float(dev_run) if dev_run else dev
    host = f"{(wall - dev_step) / rows:.2f}" if dev_step and tm and big else ""
    gap_req = f"{float(gap) / rows:.2f}" if gap else ""
    print(f"| served {lab} | {tps:,.0f} | {ratio} | {tpot:.3f} | {wall:.0f} | {rows:.1f} | {host} "
          f"| {tm.get('waited_share', '')} | {dev_run} | {gap} | {gap_req} |")
    if not big and off8:
        # like for like: the offline figure includes each request's prefill, so set it
        # against the served end-to-end latency per output token as well as the TPOT
        e2e = sum(r["latency"]["e2el"]["mean_ms"] * r["completed"] for r in res) / sum(
            r["total_output"] for r in res)
        print(f"| Llama-3.1-8B batch 1: offline ms/token {1000 / off8:.3f}; served TPOT / offline "
              f"{tpot / (1000 / off8):.3f}; served e2e latency per output token {e2e:.3f} ms, "
              f"/ offline {e2e / (1000 / off8):.3f} | | target <= 1.05 | | | | | | | | |")
print("targets: served / offline >= 0.90 at the full concurrency; host us / request / step <= 2")
EOF
