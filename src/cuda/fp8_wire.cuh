// The fp8 wire format's arithmetic (docs/contract.md), shared by the wire kernels and the fused send side: a block's
// scale from its largest magnitude, and its values scaled and rounded to fp8 two at a time.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "core/wire.h"

namespace attnprep::cuda::fp8_wire {

template <core::WireFormat F>
constexpr __nv_fp8_interpretation_t kInterp = F == core::WireFormat::E4M3FN ? __NV_E4M3 : __NV_E5M2;
template <core::WireFormat F>
constexpr float kFormatMax = F == core::WireFormat::E4M3FN ? 448.f : 57344.f;

// max(|a|, |b|) that keeps a NaN, as torch's amax does (fmaxf drops it).
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

// The largest magnitudes of K blocks (N values of type T in each of `lanes` consecutive, aligned lanes, a power of
// two), NaN where one is; 2-byte pairs compared packed, exact. Every lane of the warp calls it; one without values
// passes zeros. The K butterflies run side by side (their shuffles' latencies overlap).
template <typename T, int N, int K>
__device__ __forceinline__ void block_amax(const T* const (&e)[K], unsigned lanes, float (&amax)[K]) {
  unsigned bits[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float m = 0.f;
    if constexpr ((std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) && N % 2 == 0) {
      using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
      const T2* e2 = reinterpret_cast<const T2*>(e[k]);
      T2 m2 = __habs2(e2[0]);
#pragma unroll
      for (int i = 1; i < N / 2; ++i) m2 = __hmax2_nan(m2, __habs2(e2[i]));
      m = nan_max(__low2float(m2), __high2float(m2));
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) m = nan_max(m, fabsf(static_cast<float>(e[k][i])));
    }
    bits[k] = __float_as_uint(fabsf(m));
  }
  // a magnitude's bits order as unsigned ints (NaN, sign cleared, above infinity): a butterfly over the block's lanes
  // (__reduce_max_sync with a mask per block runs once per distinct mask in the warp)
  for (unsigned o = 1; o < lanes; o *= 2) {
#pragma unroll
    for (int k = 0; k < K; ++k) bits[k] = max(bits[k], __shfl_xor_sync(0xffffffffu, bits[k], o));
  }
#pragma unroll
  for (int k = 0; k < K; ++k) amax[k] = __uint_as_float(bits[k]);
}
template <typename T, int N>
__device__ __forceinline__ float block_amax(const T* e, unsigned lanes) {
  const T* const blocks[1] = {e};
  float amax[1];
  block_amax<T, N, 1>(blocks, lanes, amax);
  return amax[0];
}

// scale = amax / fmax, values x * (fmax / amax); both 1 when the scale is not positive (zero or NaN) or the
// inverse overflows. The quotient by fmax is a product with fmax's rounded reciprocal and one FMA correction: IEEE
// division's for every float amax whose inverse does not overflow (all checked: performance-notes.md), inf as is.
template <core::WireFormat F>
__device__ __forceinline__ void block_scale(float amax, float& scale, float& inv) {
  constexpr float kRcp = 1.f / kFormatMax<F>;
  const float q = __fmul_rn(amax, kRcp);
  scale = isinf(amax) ? q : __fmaf_rn(__fmaf_rn(-q, kFormatMax<F>, amax), kRcp, q);
  inv = __fdiv_rn(kFormatMax<F>, amax);
  if (!(scale > 0.f) || !isfinite(inv)) scale = inv = 1.f;
}

template <core::WireFormat F>
__device__ __forceinline__ uint16_t to_fp8x2(float a, float b, float inv) {
  return __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(a, inv), __fmul_rn(b, inv)), __NV_SATFINITE, kInterp<F>);
}

}  // namespace attnprep::cuda::fp8_wire
