#!/usr/bin/env bash
# Nsight Compute profiles of the installed attnprep's kernels at the
# benchmark shapes (needs a machine where ncu reads the counters: see the
# device notes). Clocks are left alone (--clock-control none). Writes
# $OUT/ncu_<name>.ncu-rep, a details page and the per-instruction (SASS)
# source page with stall samples, and prints the headline metrics.
#   tools/gpu_profile.sh rope:8 rope:8192 norm:8192 normc:128,64 fp8:2048 pack:32768,24,128,8
# rope/norm/fp8 take T[,q heads] (8 kv heads, head_dim 128, bf16; fp8: a
# float8_e4m3fn NHD pool of 16-token pages, per-tensor scales); ropec, normc
# and fp8c the same with cos/sin from a float32 cos_sin_cache (the row path).
# tritonc:T[,q heads]: the Triton peer of bench/peers.py with the QK norm on the
# same data (its one launch after autotuning, between profiler start/stop).
# TAG=name prefixes the output files (one set per build variant).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
NCU=${NCU:-ncu}

# rope_pool_fused's inputs for the rope/norm/fp8 and tritonc profiles, T and
# HQ from $arg: T tokens, HQ q heads (default 32), 8 kv heads, head_dim 128,
# pools of shape $1 and dtype $2, the QK-norm weights, a float32 cache.
rope_inputs() {
  cat <<PYCODE
import torch, attnprep
T, HQ = (($arg,) + (32,))[:2]
q = torch.randn(T, HQ, 128, device='cuda', dtype=torch.bfloat16)
k = torch.randn(T, 8, 128, device='cuda', dtype=torch.bfloat16)
v = torch.randn_like(k)
pos = torch.randint(0, 131072, (T,), device='cuda')
slots = torch.randperm(1_000_000, device='cuda')[:T]
kp = torch.zeros($1, device='cuda', dtype=torch.$2)
vp = torch.zeros_like(kp)
wq, wk = (torch.rand(128, device='cuda', dtype=torch.bfloat16) + 0.5 for _ in range(2))
cache = attnprep.rope_cos_sin_cache(128, 131072, 1e4, device='cuda')
PYCODE
}

for spec in "$@"; do
  op=${spec%%:*}
  arg=${spec#*:}
  cache_kw=""
  case $op in ropec | normc | fp8c) op=${op%c}; cache_kw=", cos_sin_cache=cache" ;; esac
  name="${TAG:+${TAG}_}${op}${cache_kw:+c}_$(echo "$arg" | tr ',' '_')"
  skip=(--launch-skip 2)
  case $op in
    tritonc)
      kernel=_rope_pool_kernel
      skip=(--profile-from-start off)
      code="
import sys
sys.path.insert(0, 'bench')
import peers
$(rope_inputs "1_000_000, 8, 128" bfloat16)
for _ in range(3):
    peers.triton_rope_pool(q, k, v, pos, slots, kp, vp, cache, wq, wk)
torch.cuda.synchronize()
print('triton warps', peers.triton_rope_pool_warps())
torch.cuda.profiler.start()
peers.triton_rope_pool(q, k, v, pos, slots, kp, vp, cache, wq, wk)
torch.cuda.synchronize()
torch.cuda.profiler.stop()" ;;
    rope | norm | fp8)  # norm: with the QK norm (q and k weights); fp8: into fp8 pages
      kernel=rope_pool_kernel
      extra_kw=$([ "$op" = norm ] && echo ", q_norm_weight=wq, k_norm_weight=wk")
      [ "$op" != fp8 ] || extra_kw=", k_scale=ks, v_scale=ks, kv_layout='NHD'"
      pool_shape=$([ "$op" = fp8 ] && echo "65536, 16, 8, 128" || echo "1_000_000, 8, 128")
      pool_dtype=$([ "$op" = fp8 ] && echo float8_e4m3fn || echo bfloat16)
      code="
$(rope_inputs "$pool_shape" "$pool_dtype")
ks = torch.tensor(0.5, device='cuda')
for _ in range(3):
    attnprep.rope_pool_fused(q, k, v, pos, slots, kp, vp, head_dim=128, num_qo_heads=HQ, num_kv_heads=8,
                             rope_base=1e4$extra_kw$cache_kw)
torch.cuda.synchronize()" ;;
    pack)
      kernel=strided_copy_kernel
      code="
import torch, attnprep
rows, heads, d, world = ($arg)
q, k, v = (torch.randn(rows, heads, d, device='cuda', dtype=torch.bfloat16) for _ in range(3))
for _ in range(3):
    attnprep.pack_qkv_destination_major(q, k, v, world_size=world)
torch.cuda.synchronize()" ;;
    *) echo "unknown op $op"; continue ;;
  esac
  $NCU --clock-control none -k "regex:$kernel" "${skip[@]}" --launch-count 1 --set full \
    --import-source no -f -o "$OUT/ncu_$name" $PY -c "$code" > "$OUT/ncu_$name.log" 2>&1 ||
    { echo "ncu $name failed:"; tail -5 "$OUT/ncu_$name.log"; continue; }
  $NCU -i "$OUT/ncu_$name.ncu-rep" --page details > "$OUT/ncu_${name}_details.txt" 2>&1
  $NCU -i "$OUT/ncu_$name.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_${name}_sass.csv" 2>&1
  echo "## ncu $name"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Issued Warp|L2 Hit Rate|Waves Per SM|No Eligible" \
    "$OUT/ncu_${name}_details.txt" | sed 's/  */ /g' | head -24
done
