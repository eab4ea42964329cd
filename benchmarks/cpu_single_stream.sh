#!/usr/bin/env bash
# Single stream 128 in / 128 out, FlowEngine against llama-server with one and two
# threads, alternated back to back (issue #20; docs/benchmarks.md, CPU section). Shorter
# than benchmarks/cpu_serve.sh, for a loaded machine: per engine one warm-up request,
# then N_PROMPTS (default 2) measured ones; each line carries the load average.
#
#   ROUNDS="1 2 3" benchmarks/cpu_single_stream.sh
#   FE_BASE="FLOWENGINE_CPU_NO_FUSED_LAYERS=1" ...   # plus FlowEngine under that env (fe-base)
#   LLAMA_T="1 2"                                    # llama-server thread counts (default)
set -uo pipefail
cd "$(dirname "$0")/.."
GGUF="${GGUF:-${HOME}/.cache/flowengine/gguf/SmolLM2-135M-Instruct.Q4_1.gguf}"
OUT="${OUT:-/tmp/flowengine-cpu-single}"
N_PROMPTS="${N_PROMPTS:-2}"
mkdir -p "${OUT}"
TOK=$(python3 -c "from flowengine.model.resolve import resolve_model; print(resolve_model('${GGUF}').path)")
LS="$(benchmarks/llamacpp_build.sh)"
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
bench() {  # port prompts output_len seed [result file]
  python3 -m flowengine.entrypoints.cli bench serve --port "$1" --model bench --tokenizer "${TOK}" \
    --dataset-name random --random-input-len 128 --random-output-len "$3" --num-prompts "$2" \
    --max-concurrency 1 --ignore-eos --seed "$4" --disable-tqdm ${5:+--result-file "$5"} >/dev/null 2>&1
}
run() {  # tag cmd...
  local tag=$1; shift; local p; p=$(port)
  "$@" --port "$p" --host 127.0.0.1 >"${OUT}/${tag}.log" 2>&1 & local pid=$!
  for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$p/v1/models" >/dev/null 2>&1 && break; sleep 0.5; done
  bench "$p" 1 16 1
  local l; l=$(cut -d' ' -f1 /proc/loadavg)
  bench "$p" "${N_PROMPTS}" 128 0 "${OUT}/${tag}.json"
  python3 -c "import json; r=json.load(open('${OUT}/${tag}.json')); print('${tag}', 'load=${l}', 'TPOT_med_ms=%.1f TTFT_med_ms=%.1f failed=%d' % (r['latency']['tpot']['median_ms'], r['latency']['ttft']['median_ms'], r['failed']))"
  kill "$pid"; wait "$pid" 2>/dev/null
}
for round in ${ROUNDS:-1 2 3}; do
  run "fe-${round}" python3 -m flowengine.entrypoints.cli serve "${GGUF}" --cpu-threads 2 \
      --max-model-len 512 --disable-log-stats --served-model-name bench
  if [[ -n "${FE_BASE:-}" ]]; then
    run "fe-base-${round}" env ${FE_BASE} python3 -m flowengine.entrypoints.cli serve "${GGUF}" \
        --cpu-threads 2 --max-model-len 512 --disable-log-stats --served-model-name bench
  fi
  for t in ${LLAMA_T:-1 2}; do
    run "llama-t${t}-${round}" "${LS}" -m "${GGUF}" -t "${t}" --parallel 1 -c 1024 --alias bench --poll 0
  done
done
