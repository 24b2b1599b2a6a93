// rope_pool_fused's rotation kernel instantiated for float q/k/v, same-dtype pools.
#include "cuda/rope_pool_launch.cuh"

template cudaError_t attnprep::cuda::rope::launch_rope_pool<float, false>(const RopePoolParams&,
                                                                          const RopePoolPointers&, cudaStream_t);
