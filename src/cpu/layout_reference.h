// Reference implementations of the layout ops, written straight from the
// formulas in docs/contract.md (one element at a time, no plan, no vectors), so that
// they can judge the kernels and the plans. Host memory only.
#pragma once

#include "core/tensor.h"

namespace attnprep::cpu {

// out[d, r, h, 0:D] = q[r, d*Hl + h, :], then k, then v. `out` contiguous.
void pack_qkv_reference(const core::TensorArg& q, const core::TensorArg& k, const core::TensorArg& v,
                        int64_t world_size, const core::TensorArg& out);

// out[b, s, w, h, :] = x[w, s, b, h, :]. `out` contiguous.
void usp_merge_heads_reference(const core::TensorArg& x, const core::TensorArg& out);

}  // namespace attnprep::cpu
