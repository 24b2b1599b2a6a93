// rope_pool_fused on CUDA: the kernel a call takes (the rotation kernel,
// cuda/rope_pool_kernel.cuh, or the general QK-norm kernel) and its element
// type; the rotation kernel's instantiations live in rope_pool_<type>.cu.
#include "cuda/rope_pool.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/rope_pool.h"
#include "cuda/rope_group.cuh"

namespace attnprep::cuda {

cudaError_t rope_pool(const RopePoolParams& params, const RopePoolPointers& ptrs, core::DType dtype,
                      cudaStream_t stream) {
  if (params.num_tokens == 0) return cudaSuccess;
  // grid.x holds the tokens; item indices within a token are 32-bit, with
  // room for a block's last round past the token's end.
  if (params.num_tokens >= (int64_t{1} << 31) || core::rope_items_per_token(params) >= (int64_t{1} << 30))
    return cudaErrorInvalidConfiguration;
  if ((params.norm_q || params.norm_k) && !core::rope_norm_in_rotation_kernel(params))
    return rope::rope_norm_pool(params, ptrs, dtype, stream);
  return rope::with_element_type(dtype, params.pool_fp8 != 0 || params.q_fp8 != 0, [&](auto element, auto fp8) {
    return rope::launch_rope_pool<decltype(element), decltype(fp8)::value>(params, ptrs, stream);
  });
}

}  // namespace attnprep::cuda
