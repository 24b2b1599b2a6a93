// The element types the kernels compute on: conversions to and from float32
// (rounding to nearest even), shared by every CUDA kernel file.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace attnprep::cuda::elements {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Two adjacent elements to float32 and back through their 32-bit word: one instruction per bfloat16 element and one
// conversion per pair back, against two each one at a time.
__device__ __forceinline__ float2 to_float2(const float* e) { return make_float2(e[0], e[1]); }
__device__ __forceinline__ float2 to_float2(const __half* e) {
  return __half22float2(*reinterpret_cast<const __half2*>(e));
}
__device__ __forceinline__ float2 to_float2(const __nv_bfloat16* e) {
  const uint32_t w = *reinterpret_cast<const uint32_t*>(e);
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
__device__ __forceinline__ void from_float2(float* e, float a, float b) {
  e[0] = a;
  e[1] = b;
}
__device__ __forceinline__ void from_float2(__half* e, float a, float b) {
  *reinterpret_cast<__half2*>(e) = __floats2half2_rn(a, b);
}
__device__ __forceinline__ void from_float2(__nv_bfloat16* e, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(e) = __floats2bfloat162_rn(a, b);
}

}  // namespace attnprep::cuda::elements
