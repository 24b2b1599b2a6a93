// pack_qkv_destination_major: the checks of SPEC.md section 1, in order, and
// the copy plan that packs q, k and v destination-major in one launch.
#pragma once

#include <cstdint>

#include "core/strided_copy.h"
#include "core/tensor.h"

namespace attnprep::core {

struct PackQkvShape {
  int64_t world_size, rows, global_heads, local_heads, head_size;
  // [world_size, rows, local_heads, 3 * head_size]
  int64_t out_shape[4];
};

// Runs checks 1-5 (q, k, v, world_size). Check 6 needs the output and runs in
// check_pack_qkv_out, so the bindings can allocate the output in between.
PackQkvShape check_pack_qkv_inputs(const TensorArg& q, const TensorArg& k, const TensorArg& v,
                                   int64_t world_size);

// Check 6: `out` is contiguous with the expected shape, device and dtype.
void check_pack_qkv_out(const PackQkvShape& shape, const TensorArg& q, const TensorArg& out);

// The three copy jobs (q, k, v into their thirds of each output row).
StridedCopyPlan plan_pack_qkv(const PackQkvShape& shape, const TensorArg& q, const TensorArg& k,
                              const TensorArg& v, const TensorArg& out);

}  // namespace attnprep::core
