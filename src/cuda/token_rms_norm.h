// CUDA launcher of qk_norm_rope's per-token QK norm (core/token_rms_norm.h).
#pragma once

#include <cuda_runtime_api.h>

#include "core/tensor.h"
#include "core/token_rms_norm.h"

namespace attnprep::cuda {

// out = the norm of x over each token's heads * head_dim elements, times the weight (out may be x itself); `dtype`
// is x's (float16, bfloat16 or float32).
cudaError_t token_rms_norm(const TokenNormParams& p, const void* x, const void* weight, void* out, core::DType dtype,
                           cudaStream_t stream);

}  // namespace attnprep::cuda
