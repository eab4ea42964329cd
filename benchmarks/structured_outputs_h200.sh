#!/bin/bash
# Issue 13 on the H200 (one device call): JSON-schema constrained against unconstrained,
# AsyncEngine with async scheduling, in-process (free / JSON with the grammar work in
# the Scheduler actor's worker thread / JSON with it inline on the loop) and multiproc,
# Llama-3.1-8B shapes with SmolLM2's vocabulary, random bf16 weights.
#
# Here (the model dir holds only config and tokenizer files, 3.4 MB; the H200 host has
# neither pydantic nor apache-tvm-ffi, which xgrammar 0.2.9 imports):
#   C=/work/main/.carry-grammar; rm -rf $C && mkdir -p $C/.xwhl
#   git archive HEAD | tar -x -C $C
#   python benchmarks/structured_outputs.py --write-model-dir $C/bm
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     -d $C/.xwhl apache-tvm-ffi==0.1.15.post2 pydantic==2.13.4 pydantic-core==2.46.4 \
#     annotated-types==0.7.0 typing-inspection==0.4.2
# Then the device call, carry [".whl", ".carry-grammar"]:
#   timeout 195 bash .carry-grammar/benchmarks/structured_outputs_h200.sh
# Logs and raw runs land in $OUT (inproc.log/json, multiproc.log/json).
cd "$(dirname "$0")/.." || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  ../.whl/*.whl .xwhl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
rm -rf flowengine/kernels && ln -sfn ../kernels flowengine/kernels
python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || echo "build_ext failed"
B="python3 benchmarks/structured_outputs.py --model bm --load-format dummy --device cuda \
--output-len 128 --reps 2 --async-scheduling --no-compile-times"
run() {  # name, timeout, args...
  local name=$1 t=$2; shift 2
  echo "== $name $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  timeout "$t" "$@" --json-out "$OUT/$name.json" > "$OUT/$name.log" 2>&1; echo "rc=$?"
  grep -E "^engine:|^\| (1|128) \||^single" "$OUT/$name.log"
}
run inproc 80 $B --batch-sizes 1 128 --placement inproc --inline-variant
run multiproc 55 $B --batch-sizes 1 128 --placement multiproc
echo "== end $(date +%T)"
