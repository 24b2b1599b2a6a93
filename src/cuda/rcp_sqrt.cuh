// 1 / sqrt(v) with the root and the reciprocal each correctly rounded: the
// QK norm's factor (docs/contract.md, rope_pool_fused), bit for bit what
// __frcp_rn(__fsqrt_rn(v)) and the CPU reference's 1.0f / std::sqrt(v) give.
#pragma once

namespace attnprep::cuda {

// RN(1 / RN(sqrt(v))) for every float: for v in [2^-101, FLT_MAX] the common paths of __fsqrt_rn and __frcp_rn under
// one range check made beside the arithmetic (the intrinsics each check first, in a chain); every other v takes the
// intrinsics. tests/cpp/test_cuda_rcp_sqrt.cu compares the two over all 2^32 floats.
__device__ __forceinline__ float rcp_sqrt_rn(float v) {
  float y, r;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(v));
  const float s0 = __fmul_rn(v, y);
  const float s = __fmaf_rn(__fmaf_rn(-s0, s0, v), __fmul_rn(y, 0.5f), s0);  // RN(sqrt(v))
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(s));
  r = __fmaf_rn(r, -__fmaf_rn(r, s, -1.f), r);  // RN(1 / s)
  if (__float_as_uint(v) - 0x0d000000u > 0x727fffffu) r = __frcp_rn(__fsqrt_rn(v));
  return r;
}

}  // namespace attnprep::cuda
