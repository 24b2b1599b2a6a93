// The parameter block of qk_norm_rope's per-token QK norm, shared verbatim by the host, the CUDA and the Metal
// kernel: fixed-width fields only (the static_asserts pin the layout).
#pragma once

#if defined(__METAL_VERSION__)
#include <metal_stdlib>
typedef long ap_norm_i64;
typedef int ap_norm_i32;
#else
#include <cstddef>
#include <cstdint>
typedef int64_t ap_norm_i64;
typedef int32_t ap_norm_i32;
#endif

// Strides in elements; element (t, h, d) of x is at t * x_stride_token + h * x_stride_head + d.
struct TokenNormParams {
  ap_norm_i64 tokens, heads, head_dim;
  ap_norm_i64 x_stride_token, x_stride_head, out_stride_token, out_stride_head;
  ap_norm_i32 padded;      // heads * head_dim rounded up to a power of two: the pairwise sum's width
  ap_norm_i32 weight_f32;  // 1: float32 weights; 0: x's dtype
  float eps, offset;
};

#if !defined(__METAL_VERSION__)
static_assert(sizeof(TokenNormParams) == 7 * 8 + 4 * 4, "TokenNormParams layout must match the Metal side");
static_assert(offsetof(TokenNormParams, padded) == 56, "layout");
#endif
