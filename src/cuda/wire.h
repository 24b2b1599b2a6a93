// CUDA launcher of the fp8 wire kernels (see core/wire.h).
#pragma once

#include <cuda_runtime_api.h>

#include "core/wire.h"

namespace attnprep::cuda {

// Enqueues the plan on `stream` (quantize: plain side -> wire; else wire ->
// plain side). The caller has checked core::wire_kernel_applies. Returns the
// launch status, never throws.
cudaError_t wire_transfer(const core::WirePlan& plan, cudaStream_t stream);

}  // namespace attnprep::cuda
