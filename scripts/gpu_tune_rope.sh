#!/usr/bin/env bash
# Tuning pass for the rope_pool kernel's launch shape: rebuilds with each
# variant (the kernel's ATTNPREP_ROPE_* macros) and prints attnprep's
# benchmark rows for each (no peers).
#   scripts/gpu_tune_rope.sh "THREADS=128,MIN_BLOCKS=10 THREADS=128,MIN_BLOCKS=10,SPLIT_BELOW=1000000000" [token counts]
# AFTER="command" runs after each variant's benchmark, with TAG set to the
# variant's name (e.g. AFTER="bash scripts/gpu_profile.sh rope:8192").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
ts=${2:-1,8,128,512,2048,8192,32768}
for v in $1; do
  flags=$(echo "$v" | tr ',' '\n' | sed 's/^/-DATTNPREP_ROPE_/' | tr '\n' ' ')
  name=$(echo "$v" | tr ',=' '__')
  ATTNPREP_CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90;-DCMAKE_CUDA_FLAGS=$flags" \
    ATTNPREP_BUILD_DIR=build/tune bash scripts/setup.sh > "$OUT/tune_build_$name.log" 2>&1 || { tail -20 "$OUT/tune_build_$name.log"; continue; }
  echo "## variant $v"
  python3 bench/bench_rope_pool.py --no-peers --ts "$ts" 2>&1 | grep -E "^\|" | cut -d'|' -f2-7 | tee "$OUT/tune_$name.md"
  [ -z "${AFTER:-}" ] || TAG=$name bash -c "$AFTER"
done
