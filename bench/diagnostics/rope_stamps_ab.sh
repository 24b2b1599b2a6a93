#!/usr/bin/env bash
# A/B of builds of rope_pool.cu on the rope_stamps.cu replay harness (built
# with -DATTNPREP_STAMPS_OFF): each git revision's src/ with this tree's
# harness, graph replay per call, the builds run in turn for ROUNDS rounds,
# then every build's output hashes (q_rot, k_rot and the pool rows written)
# against the first build's, case by case: "same" everywhere, or the builds
# do not compute the same values.
#   bench/diagnostics/rope_stamps_ab.sh [-r ROUNDS] [-t "T ..."] REV [REV ...]
#   e.g. bench/diagnostics/rope_stamps_ab.sh -t "1 128 2048" main next/table-v
# Binaries go to build/rope_stamps/<commit>_off (kept: a second run reuses
# them); builds for sm_90 unless CUDA_ARCH says otherwise; one nvcc per
# revision, in parallel.
set -uo pipefail
cd "$(dirname "$0")/../.."
rounds=3 tokens="128 1"
while getopts "r:t:" o; do
  case $o in r) rounds=$OPTARG ;; t) tokens=$OPTARG ;; *) exit 2 ;; esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || { echo "usage: $0 [-r ROUNDS] [-t \"T ...\"] REV [REV ...]" >&2; exit 2; }
out=build/rope_stamps
mkdir -p "$out"
harness=$PWD/bench/diagnostics
revs=("$@") bins=()
for rev in "$@"; do
  sha=$(git rev-parse --short=12 "$rev^{commit}") || exit 1
  bin=$out/${sha}_off
  bins+=("$bin")
  [ -x "$bin" ] && continue
  (
    src=$(mktemp -d)
    git archive "$sha" src | tar -x -C "$src"
    # the harness includes ../../src/cuda/rope_pool.cu: beside the revision's src/
    mkdir -p "$src/bench/diagnostics"
    cp "$harness/rope_stamps.cu" "$harness/graph_replay.h" "$src/bench/diagnostics/"
    nvcc -O3 -std=c++17 -arch="sm_${CUDA_ARCH:-90}" --expt-relaxed-constexpr -DATTNPREP_WITH_CUDA=1 \
      -DATTNPREP_STAMPS_OFF -I "$src/src" -I "$src/bench/diagnostics" "$src/bench/diagnostics/rope_stamps.cu" \
      "$src/src/cuda/launch.cu" "$src/src/cuda/rope_norm_pool.cu" "$src"/src/core/*.cpp -o "$bin" > "$bin.log" 2>&1 ||
      { echo "build of $rev failed: $bin.log" >&2; rm -f "$bin"; }
    rm -rf "$src"
  ) &
done
wait
for bin in "${bins[@]}"; do [ -x "$bin" ] || exit 1; done
for r in $(seq "$rounds"); do
  for i in "${!bins[@]}"; do
    echo "== $(basename "${bins[$i]}") (${revs[$i]}) round $r"
    "${bins[$i]}" $tokens > "${bins[$i]}.txt" || { cat "${bins[$i]}.txt"; exit 1; }
    grep -v alternate "${bins[$i]}.txt" | sed 's/ (no stamps)//'
  done
done
key() { sed -nE 's/^(T=[0-9]+ [0-9]+\/8 [a-z_]+):.*outputs ([0-9a-f]+)$/\1|\2/p' "$1" | tr ' ' '_' | sort; }
for bin in "${bins[@]:1}"; do
  echo "== hashes: $(basename "$bin") against $(basename "${bins[0]}")"
  join -t'|' <(key "${bins[0]}.txt") <(key "$bin.txt") |
    awk -F'|' '{print $1, ($2 == $3 ? "same" : "DIFFERENT " $2 " " $3)}'
done
