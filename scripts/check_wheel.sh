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
# own packages (torch, pytest, libclang) through a .pth line placed after its
# own site-packages, so the wheel's attnprep is the one imported.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
wheel=$(readlink -f "$1")
work=$(mktemp -d)
$PY -m venv "$work/venv"
VPY="$work/venv/bin/python"
# The wheel first: pip would take an attnprep on the host's path for installed.
"$VPY" -m pip install -q --no-deps --no-index "$wheel"
if [ "${ATTNPREP_CHECK_OFFLINE:-0}" = 1 ]; then
  $PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
    > "$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_host_packages.pth"
else
  torch_req=${ATTNPREP_TORCH:-torch==$($PY -c "import torch; print(torch.__version__.split('+')[0])")}
  "$VPY" -m pip install -q "$torch_req" pytest libclang
fi
# What the tests read beside the package: the kernel source (the Metal
# syntax pass), the benchmarks' peers and columns, the example model loop,
# the README's snippets.
cp -r tests src bench examples README.md "$work/"
cd "$work"
"$VPY" -c "import attnprep, torch; print(attnprep.build_info()); print('torch', torch.__version__, 'from', torch.__file__)
assert attnprep.__file__.startswith('$work/venv/'), attnprep.__file__"
"$VPY" -m pytest -q tests/python -p no:cacheprovider
