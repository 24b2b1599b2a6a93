#!/usr/bin/env bash
# One pass on a GPU machine: the README's two commands exactly as written
# (main job; all tests), then the benchmarks named (default: none; "all" for
# every bench/bench_*.py). Logs go to $OUT (or bench/out); the last lines
# summarise, benchmark tables last.
#   tools/gpu_run.sh [all | bench_name ...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared multi-GPU hosts
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"

# A GPU machine without a package index: wheels carried in .whl/ (an
# ignored folder; e.g. libclang, which the Metal source test needs) are
# installed first, so that the set-up below finds them.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps .whl/*.whl > "$OUT/wheels.log" 2>&1 || tail -3 "$OUT/wheels.log"
fi
start=$(date +%s)
(bash scripts/setup.sh && python3 -m attnprep) > "$OUT/main.log" 2>&1
echo "main job rc=$? ($(( $(date +%s) - start )) s): $(tail -1 "$OUT/main.log")"
start=$(date +%s)
bash scripts/test.sh > "$OUT/test.log" 2>&1
echo "tests rc=$? ($(( $(date +%s) - start )) s): $(grep -E '^=+ .*(passed|failed)' "$OUT/test.log" | tail -1)"
echo "ctest: $(grep -E 'tests passed|tests failed' "$OUT/test.log")"
grep -E "^(FAILED|ERROR) " "$OUT/test.log" | head -30

benches=("$@")
[ "${benches[0]:-}" != all ] || benches=($(ls bench/bench_*.py | xargs -n1 basename | sed 's/^bench_//; s/\.py$//'))
for b in "${benches[@]}"; do
  [ "$b" != ulysses_dist ] || continue  # needs one process per GPU: run it on its own
  python3 bench/bench_$b.py > "$OUT/bench_$b.md" 2>&1 || echo "bench $b failed: $(tail -5 "$OUT/bench_$b.md")"
done
grep -A12 "### Short benchmark" "$OUT/main.log"
for b in "${benches[@]}"; do [ ! -f "$OUT/bench_$b.md" ] || cat "$OUT/bench_$b.md"; done
