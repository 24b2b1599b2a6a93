#!/usr/bin/env bash
# Tuning pass for the rope_pool kernel (its ATTNPREP_ROPE_* macros): attnprep's
# benchmark rows for each variant (no peers); scripts/gpu_tune.sh does the work.
#   scripts/gpu_tune_rope.sh "THREADS=128,MIN_BLOCKS=10 PREFETCH_AHEAD=0" [token counts]
# AFTER="command" runs after each variant's benchmark, with TAG set to the
# variant's name (e.g. AFTER="bash scripts/gpu_profile.sh rope:8192").
set -uo pipefail
cd "$(dirname "$0")/.."
variants=$(for v in $1; do echo "$v" | tr ',' '\n' | sed 's/^/ATTNPREP_ROPE_/' | paste -sd,; done)
exec bash scripts/gpu_tune.sh "$variants" python3 bench/bench_rope_pool.py --no-peers --ts "${2:-1,8,128,512,2048,8192,32768}"
