// usp_merge_heads: [W, S, B, h_local, D] -> [B, S, W, h_local, D], the output
// side of Ulysses attention (docs/contract.md). Checks and copy plan.
#pragma once

#include "core/strided_copy.h"
#include "core/tensor.h"

namespace attnprep::core {

// Raises ValueError unless x is a 5-D CUDA float16/bfloat16/float32 tensor
// whose output fits in int64 bytes.
// Fills `out_shape` with [B, S, W, h_local, D].
void check_usp_merge_heads(const TensorArg& x, int64_t out_shape[5]);

// One copy job: out[b, s, w, h, :] = x[w, s, b, h, :]; x strides arbitrary.
StridedCopyPlan plan_usp_merge_heads(const TensorArg& x, const TensorArg& out);

}  // namespace attnprep::core
