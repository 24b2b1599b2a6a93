// qk_norm_rope's own checks (docs/contract.md): the shapes of its batched form, before rope_pool_fused's checks on
// the tensors it passes on.
#pragma once

#include "core/tensor.h"

namespace attnprep::core {

// q and k [T, heads, head_dim] or [B, S, heads, head_dim] with the same leading dimensions; positions (null: none)
// of those leading dimensions, after a 3 with M-RoPE. Throws ValueError.
void check_qk_norm_rope(const TensorArg& q, const TensorArg& k, const TensorArg* positions, bool mrope);

}  // namespace attnprep::core
