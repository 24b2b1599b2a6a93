#!/usr/bin/env bash
# A/B pass on a GPU machine: other revisions of attnprep (`git archive`
# tarballs, e.g. `git archive -o .base/base.tar HEAD` or a branch) against
# this tree, installed in turn (A B ... this, A B ... this, ...), a benchmark
# command run after each install; prints the benchmark's table rows under the
# name of each build.
#   tools/gpu_ab.sh ".base/base.tar .base/variant.tar" 2 python3 tools/rope_quick.py
# Builds for sm_90: each tarball in /tmp/ab_<name>/build/dev, this tree in
# build/dev (incremental after the first round).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
tars=$1 rounds=$2
shift 2
trees=()
for t in $tars; do
  d=/tmp/ab_$(basename "$t" .tar)
  rm -rf "$d" && mkdir -p "$d" && tar -xf "$t" -C "$d" || exit 1
  trees+=("$d")
done
trees+=("$PWD")
for r in $(seq "$rounds"); do
  for tree in "${trees[@]}"; do
    name=$([ "$tree" = "$PWD" ] && echo this || basename "$tree")
    (cd "$tree" && ATTNPREP_CMAKE_ARGS=-DCMAKE_CUDA_ARCHITECTURES=90 bash scripts/setup.sh) > "$OUT/ab_build_$name.log" 2>&1 ||
      { tail -20 "$OUT/ab_build_$name.log"; exit 1; }
    echo "## $name (round $r)"
    "$@" 2>&1 | grep -E "^\||Error|error" | tee -a "$OUT/ab_$name.md"
  done
done
