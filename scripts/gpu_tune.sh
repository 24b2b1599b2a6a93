#!/usr/bin/env bash
# Tuning pass: rebuilds attnprep (build/tune) with each variant of build-time
# macros and runs a benchmark command after each build, printing its table rows.
#   scripts/gpu_tune.sh "ATTNPREP_COPY_UNROLL=4 ATTNPREP_COPY_UNROLL=8,ATTNPREP_COPY_THREADS=128" \
#       python3 bench/bench_pack_qkv.py --no-peers
# A variant is a comma-separated list of MACRO=VALUE. AFTER="command" runs
# after each variant's benchmark, with TAG set to the variant's name.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
variants=$1
shift
for v in $variants; do
  flags=$(echo "$v" | tr ',' '\n' | sed 's/^/-D/' | tr '\n' ' ')
  name=$(echo "$v" | sed 's/ATTNPREP_//g' | tr ',=' '__')
  ATTNPREP_CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90;-DCMAKE_CUDA_FLAGS=$flags" \
    ATTNPREP_BUILD_DIR=build/tune bash scripts/setup.sh > "$OUT/tune_build_$name.log" 2>&1 || { tail -20 "$OUT/tune_build_$name.log"; continue; }
  echo "## variant $v"
  "$@" 2>&1 | grep -E "^\|" | tee "$OUT/tune_$name.md"
  [ -z "${AFTER:-}" ] || TAG=$name bash -c "$AFTER"
done
