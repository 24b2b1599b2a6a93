// rope_pool_fused (SPEC.md section 3): the checks with the documented
// messages, in order, and the launch parameters. One implementation for the
// CUDA and the Metal backends.
#pragma once

#include <cstdint>
#include <vector>

#include "core/rope_pool_params.h"
#include "core/tensor.h"

namespace attnprep::core {

struct RopePoolArgs {
  TensorArg q, k, v, positions, slots, k_pool, v_pool;
  bool has_cache = false;
  TensorArg cos_sin_cache;      // [max_position, rotary_dim], float32 or bfloat16
  int64_t head_dim = 0, num_qo_heads = 0, num_kv_heads = 0;
  double rope_base = 10000.0;
  int64_t rotary_dim = -1;      // -1: head_dim
  bool is_neox = true;

  int64_t rot() const { return rotary_dim < 0 ? head_dim : rotary_dim; }
};

// All checks, in the documented order; throws ValueError.
void check_rope_pool(const RopePoolArgs& a);

// float32(1 / base^(2i / rotary_dim)) for i < rotary_dim / 2, computed in
// double precision and rounded once, as SPEC.md defines it.
std::vector<float> rope_inv_freq(double base, int64_t rotary_dim);

// Kernel parameters for checked arguments and the outputs q_rot/k_rot (the
// inputs themselves when inplace). `vector_bytes` is the widest access the
// backend issues (16 on CUDA and Metal); the plan drops to one element per
// access when an address, a stride or a size does not allow it.
RopePoolParams make_rope_pool_params(const RopePoolArgs& a, const TensorArg& q_rot, const TensorArg& k_rot,
                                     int vector_bytes = 16);

// How the Metal kernel (src/metal/rope_pool.metal) is dispatched: one
// threadgroup per token. Built here, once, for the MPS dispatcher
// (python/attnprep/metal.py through the binding) and for the Linux emulation.
struct MetalDispatch {
  RopePoolParams params;
  int64_t threadgroups;
  int32_t threads_per_group;
};
MetalDispatch plan_rope_pool_metal(const RopePoolArgs& a, const TensorArg& q_rot, const TensorArg& k_rot);

// Work items of one token: num_qo_heads + num_kv_heads heads to rotate, then
// num_kv_heads heads of v to copy.
inline int64_t rope_items_per_token(const RopePoolParams& p) {
  return static_cast<int64_t>(p.num_qo_heads + p.num_kv_heads) * p.qk_items_per_head +
         static_cast<int64_t>(p.num_kv_heads) * p.v_items_per_head;
}

}  // namespace attnprep::core
