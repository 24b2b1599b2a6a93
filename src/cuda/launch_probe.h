#pragma once

#include <cuda_runtime_api.h>

namespace attnprep::cuda {

// Host microseconds per launch of an empty kernel, over `launches` launches
// without a sync (the stream is synchronised before and after).
double empty_launch_us(int launches, cudaStream_t stream);

}  // namespace attnprep::cuda
