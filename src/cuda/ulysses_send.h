// CUDA launcher of the one-pass Ulysses send side (internal; see core/ulysses_send.h).
#pragma once

#include <cuda_runtime_api.h>

#include "core/tensor.h"
#include "core/ulysses_send.h"

namespace attnprep::cuda {

struct UlyssesSendPointers {
  const void *q, *k, *v;
  const void *q_norm_weight, *k_norm_weight;  // null without that norm
  const void *q_text_weight, *k_text_weight;  // rows s < text_rows (null without text rows)
  const float* cos_sin;                       // [rows, rotary_dim]
  const void* positions;                      // rows_kind == kSendPositions
  void* send;                                 // [world, S, B, n * D]
};

// One launch, a block per send row; nothing for no rows. dtype: float16, bfloat16 or float32.
cudaError_t ulysses_send(const core::UlyssesSendParams& p, const UlyssesSendPointers& ptr, core::DType dtype,
                         cudaStream_t stream);

}  // namespace attnprep::cuda
