#include "cuda/wire.h"

#include <cstdint>
#include <type_traits>

#include "cuda/elements.cuh"
#include "cuda/fp8_wire.cuh"
#include "cuda/launch.h"

namespace attnprep::cuda {
namespace {

using core::CopyJobPlan;
using core::WireCudaPolicy;
using core::WireFormat;
using core::WirePlan;
using elements::from_float;
using elements::to_float;
using fp8_wire::block_scale;
using fp8_wire::kInterp;
using fp8_wire::to_fp8x2;

constexpr int kThreads = WireCudaPolicy::threads;
constexpr int kUnits = WireCudaPolicy::units_per_thread;
constexpr int kSpan = WireCudaPolicy::vectors_per_unit;

// A unit: kSpan adjacent 16-byte vectors of one block, kN = kSpan * 16 /
// sizeof(T) values, and their kN fp8 bytes as one aligned access.
template <typename T>
constexpr int kN = kSpan * 16 / static_cast<int>(sizeof(T));
template <int N>
using Fp8Pack = std::conditional_t<N == 16, uint4, std::conditional_t<N == 8, uint2, uint32_t>>;
struct Unit {
  uint4 v[kSpan];
};

template <typename T, WireFormat F>
__device__ __forceinline__ void quantize_unit(const Unit& raw, bool has, unsigned lanes, uint64_t plain,
                                              const core::WireMap& m) {
  constexpr int N = kN<T>;
  float f[N];
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < N; ++i) f[i] = to_float(e[i]);
  // The lanes of one block are consecutive and aligned (a plan row holds
  // whole blocks, and blocks of threads hold whole rows' units in order);
  // every lane of the warp takes part in the reduction, with or without a unit.
  const float amax = fp8_wire::block_amax<T, N>(e, lanes);
  if (!has) return;
  float scale, inv;
  block_scale<F>(amax, scale, inv);
  Fp8Pack<N> packed;
  uint16_t* pairs = reinterpret_cast<uint16_t*>(&packed);
#pragma unroll
  for (int i = 0; i < N; i += 2) pairs[i / 2] = to_fp8x2<F>(f[i], f[i + 1], inv);
  int64_t value, scale_at, slot;
  core::wire_offsets(m, plain, value, scale_at, slot);
  *reinterpret_cast<Fp8Pack<N>*>(m.wire + value) = packed;
  if ((plain & ((uint64_t{1} << m.block_shift) - 1)) == 0) {  // the block's first lane: its scale
    *reinterpret_cast<float*>(m.wire + scale_at) = scale;
    if (slot + 1 == m.blocks.divisor)  // the row's last block: the row's zero padding
      for (int64_t pad = scale_at + 4; pad % 16 != 0; pad += 4) *reinterpret_cast<uint32_t*>(m.wire + pad) = 0u;
  }
}

template <typename T, WireFormat F>
__device__ __forceinline__ Unit dequantize_unit(uint64_t plain, const core::WireMap& m) {
  constexpr int N = kN<T>;
  int64_t value, scale_at, slot;
  core::wire_offsets(m, plain, value, scale_at, slot);
  const Fp8Pack<N> packed = __ldg(reinterpret_cast<const Fp8Pack<N>*>(m.wire + value));
  const float scale = __ldg(reinterpret_cast<const float*>(m.wire + scale_at));
  const auto* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&packed);
  Unit out;
  T* e = reinterpret_cast<T*>(&out);
#pragma unroll
  for (int i = 0; i < N; i += 2) {
    const float2 v = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i / 2], kInterp<F>)));
    e[i] = from_float<T>(__fmul_rn(v.x, scale));
    e[i + 1] = from_float<T>(__fmul_rn(v.y, scale));
  }
  return out;
}

// One block moves kThreads * kUnits consecutive units of one job (block b: job b % njobs, as the copy kernel); a
// unit is kSpan adjacent vectors, so the index arithmetic, the reduction and the fp8 access are paid once per kSpan.
template <typename T, WireFormat F, bool kQuantize>
__global__ void __launch_bounds__(kThreads) wire_kernel(const __grid_constant__ WirePlan p) {
  let_next_kernel_start();
  const unsigned njobs = static_cast<unsigned>(p.copy.njobs);
  const CopyJobPlan& job = p.copy.jobs[blockIdx.x % njobs];
  const int64_t base = int64_t{blockIdx.x / njobs} * (kThreads * kUnits) + threadIdx.x;
  const unsigned lanes = (1u << (p.map.block_shift - 4)) / kSpan;  // a block's units
  wait_for_prior_kernels();                                        // cuda/launch.h: before any global memory access
  Unit raw[kUnits];
  uint64_t plain[kUnits];
  unsigned char* dst[kUnits];
  bool has[kUnits];
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    const int64_t unit = base + u * kThreads;
    has[u] = unit * kSpan < job.total;
    int64_t from = 0, to = 0;
    if (has[u]) core::copy_offsets<true>(job, unit * kSpan, 16, from, to);  // the unit's first vector
    if constexpr (kQuantize) {
      plain[u] = static_cast<uint64_t>(job.dst + to - p.map.plain_base);
#pragma unroll
      for (int s = 0; s < kSpan; ++s)
        raw[u].v[s] = has[u] ? __ldg(reinterpret_cast<const uint4*>(job.src + from) + s) : make_uint4(0, 0, 0, 0);
    } else {
      plain[u] = static_cast<uint64_t>(job.src + from - p.map.plain_base);
      dst[u] = job.dst + to;
      if (has[u]) raw[u] = dequantize_unit<T, F>(plain[u], p.map);
    }
  }
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    if constexpr (kQuantize) {
      quantize_unit<T, F>(raw[u], has[u], lanes, plain[u], p.map);
    } else if (has[u]) {
#pragma unroll
      for (int s = 0; s < kSpan; ++s) reinterpret_cast<uint4*>(dst[u])[s] = raw[u].v[s];
    }
  }
}

template <typename T, WireFormat F>
cudaError_t launch(const WirePlan& p, dim3 grid, cudaStream_t stream) {
  return p.quantize ? launch_kernel(wire_kernel<T, F, true>, grid, dim3(kThreads), stream, p)
                    : launch_kernel(wire_kernel<T, F, false>, grid, dim3(kThreads), stream, p);
}

template <typename T>
cudaError_t launch_format(const WirePlan& p, dim3 grid, cudaStream_t stream) {
  return p.format == WireFormat::E4M3FN ? launch<T, WireFormat::E4M3FN>(p, grid, stream)
                                        : launch<T, WireFormat::E5M2>(p, grid, stream);
}

}  // namespace

cudaError_t wire_transfer(const WirePlan& p, cudaStream_t stream) {
  if (p.copy.max_total == 0 || p.copy.njobs == 0) return cudaSuccess;
  const int64_t per_block = int64_t{kThreads} * kUnits * kSpan;  // vectors
  const int64_t blocks = (p.copy.max_total + per_block - 1) / per_block * p.copy.njobs;
  if (blocks >= (int64_t{1} << 31)) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(blocks));
  switch (p.dtype) {
    case core::DType::Float16:
      return launch_format<__half>(p, grid, stream);
    case core::DType::BFloat16:
      return launch_format<__nv_bfloat16>(p, grid, stream);
    case core::DType::Float32:
      return launch_format<float>(p, grid, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace attnprep::cuda
