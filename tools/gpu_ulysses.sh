#!/usr/bin/env bash
# One Ulysses pass on a machine with 2+ GPUs: build, every Ulysses test (the
# NCCL ones included), bench_ulysses_dist.py's named parts, then the layer's
# GPU timeline (bench/diagnostics/ulysses_trace.py); logs in $OUT (or
# bench/out), the tables last. The timeline is of graph replays; its
# summary lines (time with no attention kernel running) print before the tables.
#   tools/gpu_ulysses.sh [parts]        # bench parts, comma-separated (default: plans)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OUT
# NVLink multicast stays off on shared multi-GPU hosts
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
parts=${1:-plans}
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps .whl/*.whl > "$OUT/wheels.log" 2>&1 || tail -3 "$OUT/wheels.log"
fi
ATTNPREP_CMAKE_ARGS=-DCMAKE_CUDA_ARCHITECTURES=90 bash scripts/setup.sh > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
start=$(date +%s)
timeout 300 python3 -m pytest -q tests/python -k ulysses > "$OUT/test_ulysses.log" 2>&1
echo "ulysses tests rc=$? ($(( $(date +%s) - start )) s): $(grep -E '^=+ .*(passed|failed)|^[0-9]+ (passed|failed)' "$OUT/test_ulysses.log" | tail -1)"
grep -E "^(FAILED|ERROR) " "$OUT/test_ulysses.log" | head -20
start=$(date +%s)
timeout 330 python3 bench/bench_ulysses_dist.py --parts "$parts" > "$OUT/bench_ulysses_dist.md" 2>&1
echo "bench rc=$? ($(( $(date +%s) - start )) s)"
shapes="8192,32,0 8192,32,1 41984,56,0 41984,56,1 75600,40,0 75600,40,1 65536,24,0 65536,24,1"
timeout 240 python3 bench/diagnostics/ulysses_trace.py --graph $shapes > "$OUT/ulysses_trace.txt" 2>&1 || echo "trace failed: $(tail -3 "$OUT/ulysses_trace.txt")"
grep -E "^## |no attention kernel" "$OUT/ulysses_trace.txt"
grep -E "^\||^###" "$OUT/bench_ulysses_dist.md"
