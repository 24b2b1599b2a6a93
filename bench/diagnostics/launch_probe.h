#pragma once

#include <cuda_runtime_api.h>

namespace attnprep::cuda {

// Host microseconds per launch of an empty kernel, over `launches` launches
// without a sync (the stream is synchronised before and after).
double empty_launch_us(int launches, cudaStream_t stream);

// One empty kernel launched as the library launches its kernels (with PDL
// where it is on), which waits for the kernel before it. Capturable.
cudaError_t launch_empty_library_kernel(cudaStream_t stream);

}  // namespace attnprep::cuda
