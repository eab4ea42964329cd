#!/usr/bin/env bash
# `flowengine bench pipeline` on two source trees, alternated (A, B, A, B, ...), each run
# with the 1-minute load average at its start: on a shared machine only the ratio of
# runs made side by side means anything.
#
#   benchmarks/pipeline_ab.sh TREE_A TREE_B RUNS [pipeline args...]
#   benchmarks/pipeline_ab.sh /work/main /work/wt-served 5 --num-streams 1000 --output-len 64
#
# Each tree is put first on PYTHONPATH and the runs start from a neutral directory, so
# `python -m` imports that tree (its C extension must be built). The per-actor table of
# every run is printed; the last lines give each tree's tokens/s and their medians.
set -uo pipefail
a=$1 b=$2 runs=$3
shift 3
cd /tmp || exit 1
declare -A toks
for i in $(seq "$runs"); do
  for tree in "$a" "$b"; do
    load=$(cut -d' ' -f1 /proc/loadavg)
    echo "### run $i, tree $tree, load average $load"
    res=$(PYTHONPATH=$tree python3 -m flowengine.entrypoints.cli bench pipeline "$@" 2>&1)
    echo "$res" | sed -n '/^| tokens delivered/,$p'
    tps=$(echo "$res" | awk -F'|' '/^\| [0-9]+ \|/ {gsub(/[ ,]/, "", $4); print $4; exit}')
    toks[$tree]="${toks[$tree]:-} $tps"
  done
done
for tree in "$a" "$b"; do
  med=$(echo "${toks[$tree]}" | tr ' ' '\n' | grep . | sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}')
  echo "tree $tree: tokens/s$(echo "${toks[$tree]}") ; median $med"
done
