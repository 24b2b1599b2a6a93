// rope_pool_fused's rotation kernel instantiated for __half q/k/v, same-dtype pools.
#include "cuda/rope_pool_launch.cuh"

template cudaError_t attnprep::cuda::rope::launch_rope_pool<__half, false>(const RopePoolParams&,
                                                                           const RopePoolPointers&, cudaStream_t);
