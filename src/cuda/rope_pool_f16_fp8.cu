// rope_pool_fused's rotation kernel instantiated for __half q/k/v, fp8 pools.
#include "cuda/rope_pool_launch.cuh"

template cudaError_t attnprep::cuda::rope::launch_rope_pool<__half, true>(const RopePoolParams&,
                                                                          const RopePoolPointers&, cudaStream_t);
