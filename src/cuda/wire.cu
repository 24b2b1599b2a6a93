#include "cuda/wire.h"

#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "cuda/elements.cuh"
#include "cuda/launch.h"

namespace attnprep::cuda {
namespace {

using core::CopyJobPlan;
using core::WireCudaPolicy;
using core::WireFormat;
using core::WirePlan;
using elements::from_float;
using elements::to_float;

constexpr int kThreads = WireCudaPolicy::threads;
constexpr int kVectors = WireCudaPolicy::vectors_per_thread;

template <WireFormat F>
constexpr __nv_fp8_interpretation_t kInterp = F == WireFormat::E4M3FN ? __NV_E4M3 : __NV_E5M2;
template <WireFormat F>
constexpr float kFormatMax = F == WireFormat::E4M3FN ? 448.f : 57344.f;

// max(|a|, |b|) that keeps a NaN, as torch's amax does (fmaxf drops it).
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

// The E values of one 16-byte vector, as float32.
template <typename T, int E>
__device__ __forceinline__ void unpack(const uint4& raw, float (&f)[E]) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < E; ++i) f[i] = to_float(e[i]);
}

// E fp8 bytes (E = 4 or 8), as one aligned store.
template <int E>
using Fp8Pack = std::conditional_t<E == 8, uint2, uint32_t>;

template <typename T, WireFormat F>
__device__ __forceinline__ void quantize_vector(const uint4& raw, bool has, unsigned lanes, uint64_t plain,
                                                const core::WireMap& m) {
  constexpr int E = 16 / sizeof(T);
  float f[E];
  unpack<T, E>(raw, f);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < E; ++i) amax = nan_max(amax, fabsf(f[i]));
  // The lanes of one block are consecutive and aligned (a plan row holds
  // whole blocks, and blocks of threads hold whole rows' vectors in order);
  // every lane of the warp shuffles, with or without a vector.
  for (unsigned o = lanes / 2; o > 0; o /= 2) amax = nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (!has) return;
  // docs/contract.md: scale = amax / fmax, values x * (fmax / amax); both 1
  // when the scale is not positive (zero or NaN) or the inverse overflows.
  float scale = __fdiv_rn(amax, kFormatMax<F>), inv = __fdiv_rn(kFormatMax<F>, amax);
  if (!(scale > 0.f) || !isfinite(inv)) scale = inv = 1.f;
  Fp8Pack<E> packed;
  uint16_t* pairs = reinterpret_cast<uint16_t*>(&packed);
#pragma unroll
  for (int i = 0; i < E; i += 2)
    pairs[i / 2] = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(f[i], inv), __fmul_rn(f[i + 1], inv)),
                                            __NV_SATFINITE, kInterp<F>);
  int64_t value, scale_at, slot;
  core::wire_offsets(m, plain, value, scale_at, slot);
  *reinterpret_cast<Fp8Pack<E>*>(m.wire + value) = packed;
  if ((plain & ((uint64_t{1} << m.block_shift) - 1)) == 0) {  // the block's first lane: its scale
    *reinterpret_cast<float*>(m.wire + scale_at) = scale;
    if (slot + 1 == m.blocks.divisor)  // the row's last block: the row's zero padding
      for (int64_t pad = scale_at + 4; pad % 16 != 0; pad += 4) *reinterpret_cast<uint32_t*>(m.wire + pad) = 0u;
  }
}

template <typename T, WireFormat F>
__device__ __forceinline__ uint4 dequantize_vector(uint64_t plain, const core::WireMap& m) {
  constexpr int E = 16 / sizeof(T);
  int64_t value, scale_at, slot;
  core::wire_offsets(m, plain, value, scale_at, slot);
  const Fp8Pack<E> packed = __ldg(reinterpret_cast<const Fp8Pack<E>*>(m.wire + value));
  const float scale = __ldg(reinterpret_cast<const float*>(m.wire + scale_at));
  const auto* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&packed);
  uint4 out;
  T* e = reinterpret_cast<T*>(&out);
#pragma unroll
  for (int i = 0; i < E; i += 2) {
    const float2 v = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i / 2], kInterp<F>)));
    e[i] = from_float<T>(__fmul_rn(v.x, scale));
    e[i + 1] = from_float<T>(__fmul_rn(v.y, scale));
  }
  return out;
}

// One block moves kThreads * kVectors consecutive 16-byte vectors of one job
// of the plain side; block b serves job b % njobs (as the copy kernel does).
template <typename T, WireFormat F, bool kQuantize>
__global__ void __launch_bounds__(kThreads) wire_kernel(const __grid_constant__ WirePlan p) {
  let_next_kernel_start();
  const unsigned njobs = static_cast<unsigned>(p.copy.njobs);
  const CopyJobPlan& job = p.copy.jobs[blockIdx.x % njobs];
  const int64_t base = int64_t{blockIdx.x / njobs} * (kThreads * kVectors) + threadIdx.x;
  const unsigned lanes = 1u << (p.map.block_shift - 4);
  wait_for_prior_kernels();  // cuda/launch.h: before any global memory access
  uint4 raw[kVectors];
  uint64_t plain[kVectors];
  unsigned char* dst[kVectors];
  bool has[kVectors];
#pragma unroll
  for (int u = 0; u < kVectors; ++u) {
    const int64_t idx = base + u * kThreads;
    has[u] = idx < job.total;
    int64_t from = 0, to = 0;
    if (has[u]) core::copy_offsets<true>(job, idx, 16, from, to);
    if constexpr (kQuantize) {
      plain[u] = static_cast<uint64_t>(job.dst + to - p.map.plain_base);
      raw[u] = has[u] ? __ldg(reinterpret_cast<const uint4*>(job.src + from)) : make_uint4(0, 0, 0, 0);
    } else {
      plain[u] = static_cast<uint64_t>(job.src + from - p.map.plain_base);
      dst[u] = job.dst + to;
      if (has[u]) raw[u] = dequantize_vector<T, F>(plain[u], p.map);
    }
  }
#pragma unroll
  for (int u = 0; u < kVectors; ++u) {
    if constexpr (kQuantize)
      quantize_vector<T, F>(raw[u], has[u], lanes, plain[u], p.map);
    else if (has[u])
      *reinterpret_cast<uint4*>(dst[u]) = raw[u];
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
  const int64_t per_block = int64_t{kThreads} * kVectors;
  const int64_t blocks = (p.copy.max_total + per_block - 1) / per_block * p.copy.njobs;
  if (blocks >= (int64_t{1} << 31)) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(blocks));
  switch (p.dtype) {
    case core::DType::Float16: return launch_format<__half>(p, grid, stream);
    case core::DType::BFloat16: return launch_format<__nv_bfloat16>(p, grid, stream);
    case core::DType::Float32: return launch_format<float>(p, grid, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace attnprep::cuda
