#!/usr/bin/env bash
# All tests: set-up and build, then pytest and ctest. GPU tests skip where
# no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
status=0
$PY -m pytest tests/python "$@" || status=$?
ctest --test-dir build/dev --output-on-failure || status=$?
exit $status
