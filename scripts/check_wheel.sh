#!/usr/bin/env bash
# Installs a built wheel into a fresh virtual environment, with no source
# tree on the path, and runs the test suite against the installed package
# (GPU tests run where a GPU is present).
#   bash scripts/check_wheel.sh dist/attnprep-*.whl
# The venv's torch: ATTNPREP_TORCH (default: the torch release of the
# interpreter that runs this script, so one wheel is checked against
# whichever torch each machine has).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
wheel=$(readlink -f "$1")
work=$(mktemp -d)
torch_req=${ATTNPREP_TORCH:-torch==$($PY -c "import torch; print(torch.__version__.split('+')[0])")}
$PY -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "$torch_req" pytest libclang
"$work/venv/bin/python" -m pip install -q --no-deps "$wheel"
cp -r tests "$work/tests"
cp -r src "$work/src"  # the Metal syntax pass reads the kernel source
cd "$work"
"$work/venv/bin/python" -c "import attnprep, sys; print(attnprep.build_info()); assert 'site-packages' in attnprep.__file__"
"$work/venv/bin/python" -m pytest -q tests/python -p no:cacheprovider
