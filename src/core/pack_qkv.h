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

// Internal variant for the Ulysses layer (grouped-query attention, and MHA
// when the exchange is chunked): q has `heads` heads, k and v `kv_heads`.
// Output [chunks, world_size, rows, (chunk_q + 2 * chunk_kv) * head_size]:
// chunk c of destination d holds that destination's local q heads
// [c * chunk_q, (c + 1) * chunk_q), then the kv heads they use, then the same
// v heads, so that each chunk is one contiguous send buffer. When kv_heads <
// world_size each destination gets the one kv head its q heads use
// (replicated, and repeated in every chunk). One chunk is the layer's
// unchunked layout.
struct PackGqaShape {
  int64_t world_size, rows, heads, kv_heads, head_size, local_q, local_kv, chunks, chunk_q, chunk_kv;
  int64_t out_shape[4];
};
// The head geometry alone (any device): shared with the layer's CPU path.
void check_ulysses_geometry(const TensorArg& q, const TensorArg& k, const TensorArg& v, int64_t world_size);
// The geometry, then: a CUDA device, unit stride in head_dim, and `chunks`
// dividing the local q heads (and the local kv heads when they are split).
PackGqaShape check_pack_qkv_gqa(const TensorArg& q, const TensorArg& k, const TensorArg& v, int64_t world_size,
                                int64_t chunks = 1);
StridedCopyPlan plan_pack_qkv_gqa(const PackGqaShape& shape, const TensorArg& q, const TensorArg& k,
                                  const TensorArg& v, const TensorArg& out);
// Whether `chunks` divides the heads of every chunk as above (any device).
void check_ulysses_chunks(int64_t local_q, int64_t local_kv, bool kv_split, int64_t chunks);

}  // namespace attnprep::core
