#!/usr/bin/env bash
# Installs a built wheel into a fresh virtual environment, with no source
# tree on the path, and runs the test suite against the installed package
# (GPU tests run where a GPU is present).
#   bash scripts/check_wheel.sh dist/attnprep-*.whl
# The venv's torch: ATTNPREP_TORCH (default: the torch release of the
# interpreter that runs this script, so one wheel is checked against
# whichever torch each machine has).
# ATTNPREP_CHECK_OFFLINE=1 (a machine with no package registry, like the GPU
# machine): nothing is downloaded; the venv sees the running interpreter's
# own packages (torch, pytest, libclang, numpy, transformers) through a .pth line placed after its
# own site-packages, so the wheel's attnprep is the one imported.
# The interpreter: PYTHON, else the first of python3, python3.13, python3.12
# that can install the wheel (an abi3 wheel needs CPython >= 3.12). The
# temporary venv and copies are removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=$(readlink -f "${1:?usage: bash scripts/check_wheel.sh dist/attnprep-*.whl}")
# the wheel's oldest CPython, from its tag (cp312-abi3 -> 3.12; cp311-cp311 -> 3.11)
tag_minor=$(basename "$wheel" | sed -E 's/.*-cp3([0-9]+)-.*/\1/')
fits() { "$1" -c "import sys; sys.exit(0 if sys.version_info[:2] >= (3, $tag_minor) else 1)" 2>/dev/null; }
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for candidate in python3 python3.13 python3.12; do
    if command -v "$candidate" >/dev/null && fits "$candidate"; then PY=$candidate; break; fi
  done
fi
[ -n "$PY" ] && fits "$PY" || { echo "check_wheel: this wheel needs CPython >= 3.$tag_minor; set PYTHON=" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
$PY -m venv "$work/venv"
VPY="$work/venv/bin/python"
# The wheel first: pip would take an attnprep on the host's path for installed.
"$VPY" -m pip install -q --no-deps --no-index "$wheel"
if [ "${ATTNPREP_CHECK_OFFLINE:-0}" = 1 ]; then
  $PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
    > "$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_host_packages.pth"
else
  torch_req=${ATTNPREP_TORCH:-torch==$($PY -c "import torch; print(torch.__version__.split('+')[0])")}
  "$VPY" -m pip install -q "$torch_req" pytest libclang numpy "transformers>=5.25,<6"
fi
# What the tests read beside the package: the kernel source (the Metal
# syntax pass), the benchmarks' peers and columns, the example model loop,
# the README's snippets.
cp -r tests src bench examples README.md "$work/"
cd "$work"
"$VPY" -c "import attnprep, torch; print(attnprep.build_info()); print('torch', torch.__version__, 'from', torch.__file__)
assert attnprep.__file__.startswith('$work/venv/'), attnprep.__file__"
"$VPY" -m pytest -q tests/python -p no:cacheprovider
