// CUDA launcher of the fused RoPE + KV-pool kernel (docs/contract.md).
#pragma once

#include <cuda_runtime_api.h>

#include "core/rope_pool_params.h"
#include "core/tensor.h"

namespace attnprep::cuda {

struct RopePoolPointers {
  const void* q;
  const void* k;
  const void* v;
  void* q_rot;  // == q when inplace
  void* k_rot;  // == k when inplace
  void* k_pool;
  void* v_pool;
  const void* positions;
  const void* slots;
  const void* cos_sin_cache;  // null unless params.use_cache
  const float* k_scale;       // fp8 pools: dequantization scales (stored = x / scale); else null
  const float* v_scale;
  const void* q_norm_weight;  // [head_dim], float32 or q's dtype, when params.norm_q; else null
  const void* k_norm_weight;  // likewise for params.norm_k
  const float* q_scale;       // params.q_fp8: q_rot stores q_rot / q_scale in float8_e4m3fn; else null
};

// One launch for q, k and v; nothing when there are no tokens. `dtype` is
// float16, bfloat16 or float32 (checked by core::check_rope_pool).
cudaError_t rope_pool(const RopePoolParams& params, const RopePoolPointers& ptrs, core::DType dtype,
                      cudaStream_t stream);

namespace rope {
// The rotation kernel for element type T (__half, __nv_bfloat16, float), kFp8: fp8 pools or fp8 q_rot (both
// checked at run time), else pools and q_rot of T; one translation unit each (cuda/rope_pool_<type>.cu).
template <typename T, bool kFp8>
cudaError_t launch_rope_pool(const RopePoolParams& params, const RopePoolPointers& ptrs, cudaStream_t stream);
// The general QK-norm kernel (cuda/rope_norm_pool.cu), for parameters with
// norm_q or norm_k set that the rotation kernel does not take
// (core::rope_norm_in_rotation_kernel); same contract as rope_pool().
cudaError_t rope_norm_pool(const RopePoolParams& params, const RopePoolPointers& ptrs, core::DType dtype,
                           cudaStream_t stream);
}  // namespace rope

}  // namespace attnprep::cuda
