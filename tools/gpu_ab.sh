#!/usr/bin/env bash
# A/B pass on a GPU machine: another revision of attnprep (a `git archive`
# tarball, e.g. `git archive -o .base/base.tar HEAD`) against this tree,
# installed in turn (A B A B ...), a benchmark command run after each install;
# prints the benchmark's table rows under the name of each build.
#   tools/gpu_ab.sh .base/base.tar 2 python3 bench/bench_rope_pool.py --no-peers
# Builds for sm_90: the base in /tmp/attnprep_base/build/dev, this tree in
# build/dev (incremental after the first round).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
base_tar=$1 rounds=$2
shift 2
base=/tmp/attnprep_base
rm -rf "$base" && mkdir -p "$base" && tar -xf "$base_tar" -C "$base" || exit 1
install() {  # $1: tree
  (cd "$1" && ATTNPREP_CMAKE_ARGS=-DCMAKE_CUDA_ARCHITECTURES=90 bash scripts/setup.sh) > "$OUT/ab_build.log" 2>&1 ||
    { tail -20 "$OUT/ab_build.log"; exit 1; }
}
for r in $(seq "$rounds"); do
  for tree in "$base" "$PWD"; do
    name=$([ "$tree" = "$base" ] && echo base || echo this)
    install "$tree"
    echo "## $name (round $r)"
    "$@" 2>&1 | grep -E "^\|" | tee -a "$OUT/ab_$name.md"
  done
done
