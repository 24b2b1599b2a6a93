// pack_qkv_destination_major: the checks of docs/contract.md, in order, and
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

// Runs checks 1-5 (q, k, v, world_size). Checks 6-7 need the output and run in
// check_pack_qkv_out, so the bindings can allocate the output in between.
PackQkvShape check_pack_qkv_inputs(const TensorArg& q, const TensorArg& k, const TensorArg& v,
                                   int64_t world_size);

// Checks 6 and 7: `out` is contiguous with the expected shape, device and
// dtype, and shares no byte with q, k or v.
void check_pack_qkv_out(const PackQkvShape& shape, const TensorArg& q, const TensorArg& k, const TensorArg& v,
                        const TensorArg& out);

// The three copy jobs (q, k, v into their thirds of each output row).
StridedCopyPlan plan_pack_qkv(const PackQkvShape& shape, const TensorArg& q, const TensorArg& k,
                              const TensorArg& v, const TensorArg& out);

// Internal variant for the Ulysses layer with grouped-query attention: q has
// `heads` heads, k and v have `kv_heads`. Output [world_size, rows, (local_q +
// 2 * local_kv) * head_size]: for each destination the local q heads, then
// the local k heads, then the local v heads. When kv_heads < world_size each
// destination gets the one kv head its q heads use (replication).
struct PackGqaShape {
  int64_t world_size, rows, heads, kv_heads, head_size, local_q, local_kv;
  int64_t out_shape[3];
};
// The head geometry alone (any device): shared with the layer's CPU path.
void check_ulysses_geometry(const TensorArg& q, const TensorArg& k, const TensorArg& v, int64_t world_size);
PackGqaShape check_pack_qkv_gqa(const TensorArg& q, const TensorArg& k, const TensorArg& v, int64_t world_size);
StridedCopyPlan plan_pack_qkv_gqa(const PackGqaShape& shape, const TensorArg& q, const TensorArg& k,
                                  const TensorArg& v, const TensorArg& out);

}  // namespace attnprep::core
