// Vector groups of the RoPE kernels: N elements moved with one 16-byte
// access, the fp8 store, and reads of indices and of the parameter block.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "core/fp8_quotient.h"
#include "core/rope_pool_params.h"
#include "cuda/copy_loads.cuh"
#include "cuda/elements.cuh"
#include "cuda/rope_pool.h"

namespace attnprep::cuda::rope {

using elements::from_float;
using elements::from_float2;
using elements::to_float;
using elements::to_float2;

// N consecutive elements, one 16-byte access when they are 16 bytes (the plan guarantees alignment), else one at a
// time; kEvictLast: an L2 evict-last load (core::RopeCudaPolicy::several_round_loads_evict_last).
template <typename T, int N>
struct Group {
  static constexpr bool kVector = N * sizeof(T) == 16;
  T e[N];
  template <bool kEvictLast = false>
  __device__ __forceinline__ void load(const T* p) {
    if constexpr (kVector) {
      *reinterpret_cast<uint4*>(e) = ::attnprep::cuda::load<uint4, kEvictLast>(reinterpret_cast<const uint4*>(p));
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) e[i] = p[i];
    }
  }
  __device__ __forceinline__ void store(T* p) const {
    if constexpr (kVector) {
      *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(e);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) p[i] = e[i];
    }
  }
  // elements 2j and 2j + 1 as float32, and set from float32 (N even)
  __device__ __forceinline__ float2 get2(int j) const { return to_float2(e + 2 * j); }
  __device__ __forceinline__ void set2(int j, float a, float b) { from_float2(e + 2 * j, a, b); }
};

// N elements, each x / scale (core::Fp8Quotient) rounded to nearest even and saturated, stored as N bytes in one
// access when N > 1 (the plan aligns fp8 rows to the group size); pairs convert in one instruction.
template <typename T, int N, typename Quotient>
__device__ __forceinline__ void store_fp8_with(const Group<T, N>& g, unsigned char* dst, Quotient quotient, int kind) {
  const __nv_fp8_interpretation_t fmt = kind == 1 ? __NV_E4M3 : __NV_E5M2;
  // packed in registers, four bytes to a word (a local byte array would go to the stack)
  uint32_t word[(N + 3) / 4] = {};
  if constexpr (N % 2 == 0) {
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      const float2 x = g.get2(j);
      const uint32_t b2 = __nv_cvt_float2_to_fp8x2(make_float2(quotient(x.x), quotient(x.y)), __NV_SATFINITE, fmt);
      word[j / 2] |= b2 << (16 * (j % 2));
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const uint32_t b = __nv_cvt_float_to_fp8(quotient(to_float(g.e[i])), __NV_SATFINITE, fmt);
      word[i / 4] |= b << (8 * (i % 4));
    }
  }
  if constexpr (N == 8) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(word[0], word[1]);
  } else if constexpr (N == 4) {
    *reinterpret_cast<uint32_t*>(dst) = word[0];
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = static_cast<unsigned char>(word[i / 4] >> (8 * (i % 4)));
  }
}
// The quotient's path chosen once for the group, not per value.
template <typename T, int N>
__device__ __forceinline__ void store_fp8(const Group<T, N>& g, unsigned char* dst, const core::Fp8Quotient& q,
                                          int kind) {
  if (q.fast)
    store_fp8_with(g, dst, [&](float x) { return q.by_reciprocal(x); }, kind);
  else
    store_fp8_with(g, dst, [&](float x) { return q.by_division(x); }, kind);
}

__device__ __forceinline__ int64_t read_index(const void* p, int64_t i, int is64) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// A float of the __grid_constant__ parameter block read through its generic address: a warp's 32 consecutive floats
// take one coalesced load instead of 32 indexed parameter-bank reads. Volatile, so it stays where it is written.
__device__ __forceinline__ float read_param_float(const float* a) {
  float v;
  asm volatile("ld.f32 %0, [%1];" : "=f"(v) : "l"(a));
  return v;
}

// Calls f(T{}, std::integral_constant<bool, fp8>{}) for the element type and
// the pool kind: the one dtype switch of both launchers.
template <typename F>
cudaError_t with_element_type(core::DType dtype, bool fp8, F&& f) {
  using Fp8 = std::true_type;
  using Same = std::false_type;
  switch (dtype) {
    case core::DType::Float16:
      return fp8 ? f(__half{}, Fp8{}) : f(__half{}, Same{});
    case core::DType::BFloat16:
      return fp8 ? f(__nv_bfloat16{}, Fp8{}) : f(__nv_bfloat16{}, Same{});
    case core::DType::Float32:
      return fp8 ? f(float{}, Fp8{}) : f(float{}, Same{});
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace attnprep::cuda::rope
