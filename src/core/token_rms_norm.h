// qk_norm_rope's per-token QK norm (docs/contract.md): one RMS over all heads of a token, weight of heads *
// head_dim (Wan's form); the checks with the documented messages and the kernel's parameters.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "core/token_rms_norm_params.h"

namespace attnprep::core {

struct TokenNormArgs {
  TensorArg x;       // [T, heads, head_dim], unit last stride (q or k)
  TensorArg weight;  // [heads * head_dim], float32 or x's dtype, contiguous
  TensorArg out;     // x's shape and dtype (x itself in place)
  double eps = 1e-6, offset = 0.0;
};

// The checks, in the documented order; throws ValueError.
void check_token_rms_norm(const TokenNormArgs& a);

TokenNormParams make_token_rms_norm_params(const TokenNormArgs& a);

// How the Metal kernel (src/metal/token_rms_norm.metal) is dispatched: a threadgroup per token.
constexpr int32_t kTokenNormThreads = 256;
struct TokenNormMetalDispatch {
  TokenNormParams params;
  int64_t threadgroups;
  int32_t threads_per_group;
};
TokenNormMetalDispatch plan_token_rms_norm_metal(const TokenNormArgs& a);

}  // namespace attnprep::core
