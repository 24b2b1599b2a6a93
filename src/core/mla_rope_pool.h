// mla_rope_pool_fused (docs/contract.md): the checks with the documented messages, in order, and the kernels'
// parameters. One implementation for the CUDA and the Metal backends.
#pragma once

#include <cstdint>

#include "core/rope_pool_params.h"
#include "core/tensor.h"

namespace attnprep::core {

struct MlaRopeArgs {
  TensorArg q;          // [T, heads, nope + R]
  TensorArg kv_c;       // [T, L]
  TensorArg k_pe;       // [T, R]
  TensorArg positions;  // [T], int32 or int64
  TensorArg slots;      // [T], int32 or int64
  TensorArg kv_cache;   // [slots, W] or [pages, page_size, W]: W = L + R, or L with kpe_cache
  bool has_kpe_cache = false;
  TensorArg kpe_cache;  // [..., R], kv_cache's slots
  bool has_cache = false;
  TensorArg cos_sin_cache;  // [max_position, R], float32 or bfloat16
  double rope_base = 10000.0;
  bool is_neox = false;
  bool has_norm = false;
  TensorArg kv_norm_weight;  // [L], float32 or kv_c's dtype
  double norm_eps = 1e-6;
  bool has_cache_scale = false, has_q_scale = false;
  TensorArg cache_scale, q_scale;  // float32, [] or [1]
  bool inplace = false;
};

constexpr int64_t kMlaMaxRope = 512;
constexpr int64_t kMlaMaxRank = 2048;
constexpr int64_t kMlaMaxHeadElements = int64_t{1} << 20;  // heads * q.shape[2]

// All checks, in the documented order; throws ValueError.
void check_mla_rope_pool(const MlaRopeArgs& a);

// Kernel parameters for checked arguments and the outputs (q and k_pe themselves in place). `vector_bytes`: the
// widest access of the backend; the plan drops to single elements where alignment does not allow it.
MlaRopeParams make_mla_rope_params(const MlaRopeArgs& a, const TensorArg& q_rot, const TensorArg& k_pe_rot,
                                   int vector_bytes = 16);

// The slots of a checked cache: [slots, W] or pages * page_size of [pages, page_size, W].
int64_t mla_cache_slots(const TensorArg& kv_cache);

// Threads of a block: the Metal kernel's threadgroup per token, the CUDA kernel's four warps (a warp per token).
constexpr int32_t kMlaThreads = 128;

// The Metal kernel's dispatch (mla_rope_pool in src/metal/rope_pool.metal), built here once for the MPS dispatcher
// (python/attnprep/metal.py through the binding) and for the Linux emulation.
struct MlaMetalDispatch {
  MlaRopeParams params;
  int64_t threadgroups;
  int32_t threads_per_group;
};
MlaMetalDispatch plan_mla_rope_pool_metal(const MlaRopeArgs& a, const TensorArg& q_rot, const TensorArg& k_pe_rot);

}  // namespace attnprep::core
