// rope_pool_fused's rotation kernel instantiated for float q/k/v, fp8 pools.
#include "cuda/rope_pool_launch.cuh"

template cudaError_t attnprep::cuda::rope::launch_rope_pool<float, true>(const RopePoolParams&, const RopePoolPointers&,
                                                                         cudaStream_t);
