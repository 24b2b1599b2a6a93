#!/usr/bin/env bash
# One full pass on a GPU machine: build for sm_90, the whole test suite, the
# benchmarks, the main job. Logs go to $OUT (or bench/out); the benchmark
# tables are printed last.
#   scripts/gpu_run.sh [bench_name ...]   (default: every bench/bench_*.py)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"

start=$(date +%s)
ATTNPREP_CMAKE_ARGS=-DCMAKE_CUDA_ARCHITECTURES=90 bash scripts/setup.sh > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"

$PY -m pytest tests/python -q -x -p no:cacheprovider > "$OUT/pytest.log" 2>&1; pytest_rc=$?
ctest --test-dir build/dev --output-on-failure > "$OUT/ctest.log" 2>&1; ctest_rc=$?
echo "pytest rc=$pytest_rc: $(tail -1 "$OUT/pytest.log")"
echo "ctest rc=$ctest_rc: $(grep -E 'tests passed|tests failed' "$OUT/ctest.log")"
[ $pytest_rc -eq 0 ] || grep -E "^(FAILED|ERROR)|Error" "$OUT/pytest.log" | head -30
[ $ctest_rc -eq 0 ] || grep -E "FAILED|Failed" "$OUT/ctest.log" | head -30

$PY -m attnprep --no-bench > "$OUT/main.log" 2>&1; echo "main job rc=$?"

benches=("$@")
[ ${#benches[@]} -gt 0 ] || benches=($(ls bench/bench_*.py | xargs -n1 basename | sed 's/^bench_//; s/\.py$//'))
for b in "${benches[@]}"; do
  $PY bench/bench_$b.py > "$OUT/bench_$b.md" 2>&1 || echo "bench $b failed: $(tail -5 "$OUT/bench_$b.md")"
done
for b in "${benches[@]}"; do cat "$OUT/bench_$b.md"; done
