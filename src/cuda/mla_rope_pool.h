// CUDA launcher of mla_rope_pool_fused (docs/contract.md).
#pragma once

#include <cuda_runtime_api.h>

#include "core/rope_pool_params.h"
#include "core/tensor.h"

namespace attnprep::cuda {

struct MlaRopePointers {
  const void* q;
  const void* kv_c;
  const void* k_pe;
  void* q_rot;      // == q when inplace
  void* k_pe_rot;   // == k_pe when inplace
  void* kv_cache;   // a row's L kv_c values start at its first element
  void* kpe_cache;  // kpe_cache, or kv_cache + L (a combined cache)
  const void* positions;
  const void* slots;
  const void* cos_sin_cache;   // null unless params.use_cache
  const void* kv_norm_weight;  // [L] when params.norm; else null
  const float* cache_scale;    // fp8 caches: the dequantization scale; else null
  const float* q_scale;        // params.q_fp8; else null
};

// One launch; nothing when there are no tokens. `dtype` is float16, bfloat16 or float32 (checked by
// core::check_mla_rope_pool).
cudaError_t mla_rope_pool(const MlaRopeParams& params, const MlaRopePointers& ptrs, core::DType dtype,
                          cudaStream_t stream);

}  // namespace attnprep::cuda
