// CUDA launcher of a pack walked as one flat run of vectors (core::PackFlatPlan).
#pragma once

#include <cuda_runtime_api.h>

#include "core/pack_qkv.h"

namespace attnprep::cuda {

// Enqueues the pack on `stream`. Returns the launch status, never throws.
cudaError_t pack_flat(const core::PackFlatPlan& plan, cudaStream_t stream);

}  // namespace attnprep::cuda
