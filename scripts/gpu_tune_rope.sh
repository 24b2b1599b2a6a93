#!/usr/bin/env bash
# Tuning pass for the rope_pool kernel's block size and occupancy hint:
# rebuilds with each variant and prints the benchmark table for each.
#   scripts/gpu_tune_rope.sh "128,1 128,12 256,1" [token counts]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
ts=${2:-1,8,128,512,2048,8192,32768}
for v in $1; do
  threads=${v%,*}; blocks=${v#*,}
  ATTNPREP_CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90;-DCMAKE_CUDA_FLAGS=-DATTNPREP_ROPE_THREADS=$threads -DATTNPREP_ROPE_MIN_BLOCKS=$blocks" \
    ATTNPREP_BUILD_DIR=build/tune bash scripts/setup.sh > "$OUT/tune_build_${threads}_${blocks}.log" 2>&1 || { tail -20 "$OUT/tune_build_${threads}_${blocks}.log"; continue; }
  echo "## variant threads=$threads min_blocks=$blocks"
  python3 bench/bench_rope_pool.py --ts "$ts" 2>&1 | grep -E "^\|" | tee "$OUT/tune_${threads}_${blocks}.md"
done
