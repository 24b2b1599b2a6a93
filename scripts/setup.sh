#!/usr/bin/env bash
# Installs what attnprep needs into the current python3 and builds it, with
# the C++ tests, into build/dev (kept between runs, so rebuilds are
# incremental). Works offline when everything is already installed.
#   PYTHON=...        interpreter to use (default: python3)
#   ATTNPREP_BUILD_DIR build folder (default build/dev)
#   ATTNPREP_TORCH=.. torch requirement when torch is missing (default: the
#                     release CI tests against)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

need=()
$PY -c "import torch" 2>/dev/null || need+=("${ATTNPREP_TORCH:-torch==2.13.0}")
$PY -c "import nanobind" 2>/dev/null || need+=("nanobind>=2.4")
$PY -c "import scikit_build_core" 2>/dev/null || need+=("scikit-build-core>=0.10")
command -v ninja >/dev/null || $PY -c "import ninja" 2>/dev/null || need+=("ninja")
cmake_ok=$(cmake --version 2>/dev/null | awk 'NR==1 { split($3, v, "."); print (v[1] > 3 || (v[1] == 3 && v[2] >= 24)) ? 1 : 0 }')
[ "${cmake_ok:-0}" = 1 ] || need+=("cmake>=3.24")
if [ ${#need[@]} -gt 0 ]; then
  echo "attnprep setup: installing ${need[*]}"
  $PY -m pip install -q "${need[@]}"
fi

# Test-only packages. Failing to get them (an offline GPU machine) does not
# stop the build: the tests that import them then fail loudly instead.
test_need=()
$PY -c "import pytest" 2>/dev/null || test_need+=("pytest>=7")
# numpy: torch warns at every import without it
$PY -c "import numpy" 2>/dev/null || test_need+=("numpy")
# libclang: the strict syntax pass over the Metal source (tests/python/test_metal_source.py)
$PY -c "import clang.cindex" 2>/dev/null || test_need+=("libclang>=16")
# transformers: the model tests (transformers' own models and RoPE tables as references)
TRANSFORMERS_REQ="transformers>=5.25,<6"
$PY - "$TRANSFORMERS_REQ" <<'CHECK' 2>/dev/null || test_need+=("$TRANSFORMERS_REQ")
import sys
from importlib.metadata import version
major, minor = (int(x) for x in version("transformers").split(".")[:2])
sys.exit(0 if (major, minor) >= (5, 25) and major < 6 else 1)
CHECK
# diffusers: the DiT RoPE forms' references (tests/python/test_token_rows.py)
DIFFUSERS_REQ="diffusers>=0.42,<0.43"
$PY - <<'CHECK' 2>/dev/null || test_need+=("$DIFFUSERS_REQ")
import sys
from importlib.metadata import version
sys.exit(0 if tuple(int(x) for x in version("diffusers").split(".")[:2]) == (0, 42) else 1)
CHECK
# clang-format and ruff at the versions the formatting test pins (pyproject.toml's test extra)
for tool in clang-format==21.1.8 ruff==0.17.6; do
  [ "$($PY -m pip show "${tool%%==*}" 2>/dev/null | awk '/^Version:/ { print $2 }')" = "${tool#*==}" ] || test_need+=("$tool")
done
if [ ${#test_need[@]} -gt 0 ]; then
  echo "attnprep setup: installing ${test_need[*]}"
  $PY -m pip install -q "${test_need[@]}" || echo "attnprep setup: WARNING: could not install ${test_need[*]}"
fi

echo "attnprep setup: building (build/dev)"
$PY -m pip install -q --no-build-isolation --no-deps \
  -C build-dir="${ATTNPREP_BUILD_DIR:-build/dev}" \
  -C cmake.define.ATTNPREP_BUILD_TESTS=ON \
  ${ATTNPREP_CMAKE_ARGS:+-C cmake.args="$ATTNPREP_CMAKE_ARGS"} \
  .
