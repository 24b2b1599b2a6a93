#!/usr/bin/env bash
# The CUDA ops under NVIDIA's compute-sanitizer (run after a build, on the GPU
# machine): tools/sanitize_ops.py once without it (values, time), then under
# memcheck (every op; out-of-bounds and misaligned accesses), racecheck and
# synccheck (the rope kernel, the one with shared memory and a barrier) and
# initcheck (every op; reads of memory nothing wrote). memcheck, racecheck and
# synccheck instrument attnprep's kernels only where the sanitizer can filter
# by name. Logs in $OUT.
#   tools/gpu_sanitize.sh      LIMIT=seconds per tool (default 300), TOOLS (below)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
CS=${COMPUTE_SANITIZER:-compute-sanitizer}
# one cudaMalloc per tensor, so memcheck sees each tensor's end
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
start=$(date +%s)
$PY tools/sanitize_ops.py || exit 1
echo "plain: $(( $(date +%s) - start )) s"
# instrument attnprep's kernels only (compute-sanitizer 2025.3 takes this
# filter; a version that refuses it instruments every kernel, slower)
filter=(--kernel-name kns=attnprep)
$CS "${filter[@]}" --error-exitcode 1 $PY -c "import torch; torch.zeros(1, device='cuda')" \
  > "$OUT/sanitize_filter.log" 2>&1 || filter=()
echo "$($CS --version | tail -1); kernel filter: ${filter[*]:-none}"
# The positive control: a planted read past an allocation, inside pack_qkv's
# kernel, must be reported (else a clean run below would prove nothing).
$CS --tool memcheck --error-exitcode 1 "${filter[@]}" $PY tools/sanitize_ops.py planted > "$OUT/sanitize_planted.log" 2>&1
if [ $? -ne 0 ] && grep -q "Invalid __global__ read" "$OUT/sanitize_planted.log"; then
  echo "planted out-of-bounds read: reported ($(grep -m1 -o 'Invalid __global__ read of size [0-9]* bytes' "$OUT/sanitize_planted.log"))"
else
  echo "planted out-of-bounds read: NOT reported"; tail -20 "$OUT/sanitize_planted.log"; exit 1
fi
status=0
# racecheck (the slowest) runs the rope cases of one dtype and two head sizes.
# TOOLS="racecheck rope-quick;memcheck pack" picks other runs.
runs=("memcheck pack merge rope kv norm" "racecheck rope-quick norm" "synccheck rope norm" "initcheck pack merge rope kv norm")
[ -z "${TOOLS:-}" ] || IFS=';' read -ra runs <<< "$TOOLS"
for run in "${runs[@]}"; do
  set -- $run
  tool=$1; shift
  start=$(date +%s)
  # initcheck watches every kernel: filtered, it would not see torch's kernels
  # fill the inputs and would call them uninitialized when copied to the host
  only=("${filter[@]}")
  [ "$tool" != initcheck ] || only=()
  timeout "${LIMIT:-300}" $CS --tool "$tool" --error-exitcode 1 "${only[@]}" $PY tools/sanitize_ops.py "$@" \
    > "$OUT/sanitize_$tool.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  echo "$tool ($*): rc=$rc, $(( $(date +%s) - start )) s: $(grep -E 'sanitize_ops:|ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | paste -sd' ')"
  [ $rc -eq 0 ] || grep -E -m 20 "Invalid|Error|error|hazard|at 0x" "$OUT/sanitize_$tool.log"
done
exit $status
