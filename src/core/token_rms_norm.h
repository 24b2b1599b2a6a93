// qk_norm_rope's per-token QK norm (docs/contract.md): one RMS over all heads of a token, weight of heads *
// head_dim (Wan's form); the checks with the documented messages and the kernel's parameters.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace attnprep::core {

struct TokenNormArgs {
  TensorArg x;       // [T, heads, head_dim], unit last stride (q or k)
  TensorArg weight;  // [heads * head_dim], float32 or x's dtype, contiguous
  TensorArg out;     // x's shape and dtype (x itself in place)
  double eps = 1e-6, offset = 0.0;
};

// The checks, in the documented order; throws ValueError.
void check_token_rms_norm(const TokenNormArgs& a);

struct TokenNormParams {
  int64_t tokens, heads, head_dim;
  int64_t x_stride_token, x_stride_head, out_stride_token, out_stride_head;
  int32_t padded;      // heads * head_dim rounded up to a power of two: the pairwise sum's width
  int32_t weight_f32;  // 1: float32 weights; 0: x's dtype
  float eps, offset;
};
TokenNormParams make_token_rms_norm_params(const TokenNormArgs& a);

}  // namespace attnprep::core
