#!/usr/bin/env bash
# The host side under AddressSanitizer and UndefinedBehaviorSanitizer, any
# finding fatal (no GPU needed): the C++ tests (checks, plans, CPU
# references, the Metal kernel's emulation, the checks' random-argument test),
# then the CPU pytest suite on an extension built the same way (CUDA off).
# Usage: tools/host_sanitize.sh [pytest args]; BUILD=dir picks the build folder.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD=${BUILD:-build/sanitize}
SAN="-fsanitize=address,undefined"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DATTNPREP_BUILD_CUDA=OFF \
  -DATTNPREP_BUILD_TESTS=ON -DPython_EXECUTABLE="$(command -v "$PY")" \
  -DCMAKE_CXX_FLAGS="$SAN -fno-omit-frame-pointer -fno-sanitize-recover=all" \
  -DCMAKE_EXE_LINKER_FLAGS="$SAN" -DCMAKE_SHARED_LINKER_FLAGS="$SAN" >/dev/null
# every target but the type stubs, whose generator imports the extension
# without the sanitizer's runtime loaded first
targets=$(cmake --build "$BUILD" --target help | sed -n 's/^\([A-Za-z0-9_]*\): .*/\1/p' |
          grep -E '^(test_|_C$)' | tr '\n' ' ')
cmake --build "$BUILD" --target $targets
ctest --test-dir "$BUILD" --output-on-failure

# The package from python/ with the sanitized extension beside it.
pkg="$BUILD/pkg"
rm -rf "$pkg" && mkdir -p "$pkg/attnprep/metal"
cp -r python/attnprep/. "$pkg/attnprep/"  # subpackages (ulysses, integrations) included
cp src/metal/*.metal src/core/rope_pool_params.h src/core/token_rms_norm_params.h "$pkg/attnprep/metal/"
cp docs/contract.md "$pkg/attnprep/"
cp "$BUILD"/_C*.so "$pkg/attnprep/"
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
# Python's allocations are not ours to account for; a finding aborts the process
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
PYTHONPATH="$pkg" "$PY" -m pytest -q -p no:cacheprovider tests/python "$@"
