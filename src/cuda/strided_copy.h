// CUDA launcher of the row-gather engine (see core/strided_copy.h).
#pragma once

#include <cuda_runtime_api.h>

#include "core/strided_copy.h"

namespace attnprep::cuda {

// Enqueues the plan on `stream`; launches nothing when there is nothing to
// copy. Returns the launch status, never throws.
cudaError_t strided_copy(const core::StridedCopyPlan& plan, cudaStream_t stream);

}  // namespace attnprep::cuda
