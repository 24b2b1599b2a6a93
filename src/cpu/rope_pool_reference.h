// CPU reference of rope_pool_fused, straight from docs/contract.md (float32 inv_freq and angle, cos/sin and the
// rotation in float64, the QK norm in float32 as specified): the oracle of the C++ tests and the Metal emulation.
#pragma once

#include <cstdint>
#include <vector>

#include "core/mla_rope_pool.h"
#include "core/rope_pool.h"

namespace attnprep::cpu {

struct RopePoolReference {
  std::vector<double> q_rot;         // [T, num_qo_heads, head_dim], contiguous
  std::vector<double> k_rot;         // [T, num_kv_heads, head_dim], contiguous
  std::vector<float> q_in, k_in;     // what was rotated: q and k, QK-normalized where asked; same layouts
  std::vector<bool> pos_ok;          // per token: false when a cos_sin_cache row was out of range (outputs NaN)
  std::vector<int64_t> pool_writer;  // per slot (pages * page_size of a paged pool): the token that writes it, or -1
};

// Reads the host tensors of checked arguments (float16/bfloat16/float32).
RopePoolReference rope_pool_reference(const core::RopePoolArgs& a);

// mla_rope_pool_fused's reference: rope_pool_fused's over q's rope parts ([T, heads, R] views of q, as its q) and
// k_pe (as a k of one head), without pools; kv_c normalized row by row (rms_norm_head over L), and the writers.
struct MlaReference {
  RopePoolReference rope;             // q_rot [T, heads, R] and k_rot [T, 1, R]: the rotated rope parts
  std::vector<float> latent;          // [T, L]: kv_c normalized (in its dtype) or copied
  std::vector<int64_t> cache_writer;  // per cache slot: the token that writes it, or -1
};
MlaReference mla_rope_pool_reference(const core::MlaRopeArgs& a);

// One head RMS-normalized as docs/contract.md defines the QK norm, in float32
// step by step: x holds the head's values (exact in dtype `dt`), weight is
// the [head_dim] host tensor; the result is rounded to `dt`.
std::vector<float> rms_norm_head(const std::vector<float>& x, const core::TensorArg& weight, core::DType dt, double eps,
                                 double offset);

// Element (t, h, d) of a [T, H, D] host tensor as double.
double read_element(const core::TensorArg& t, int64_t i0, int64_t i1, int64_t i2);

}  // namespace attnprep::cpu
