// rope_pool_fused's rotation kernel instantiated for __nv_bfloat16 q/k/v, same-dtype pools.
#include "cuda/rope_pool_launch.cuh"

template cudaError_t attnprep::cuda::rope::launch_rope_pool<__nv_bfloat16, false>(const RopePoolParams&,
                                                                                  const RopePoolPointers&,
                                                                                  cudaStream_t);
