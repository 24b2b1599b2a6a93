// CPU reference of rope_pool_fused, straight from docs/contract.md: correctly
// rounded float32 inv_freq, float32 angle, then cos/sin and the rotation in
// float64. The oracle of the C++ tests and of the Metal emulation.
#pragma once

#include <cstdint>
#include <vector>

#include "core/rope_pool.h"

namespace attnprep::cpu {

struct RopePoolReference {
  std::vector<double> q_rot;  // [T, num_qo_heads, head_dim], contiguous
  std::vector<double> k_rot;  // [T, num_kv_heads, head_dim], contiguous
  std::vector<bool> pos_ok;   // per token: false when a cos_sin_cache row was out of range (outputs NaN)
  std::vector<int64_t> pool_writer;  // per slot (pages * page_size of a paged pool): the token that writes it, or -1
};

// Reads the host tensors of checked arguments (float16/bfloat16/float32).
RopePoolReference rope_pool_reference(const core::RopePoolArgs& a);

// Element (t, h, d) of a [T, H, D] host tensor as double.
double read_element(const core::TensorArg& t, int64_t i0, int64_t i1, int64_t i2);

}  // namespace attnprep::cpu
