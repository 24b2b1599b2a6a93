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

// A small pack (under CopyCudaPolicy::small_below vectors, every address
// and stride a multiple of 16 bytes) walked as one flat run of the output's
// 16-byte vectors: output vector i is vector i % seg of segment (i / seg) % 3
// (q, k or v) of output row i / (3 * seg). One pass in output order, one
// vector per thread: a call alone costs less than the engine's three jobs
// over a 4-D index (docs/performance-notes.md, copy engine).
// 112 bytes: the kernel's parameters on two 64-byte lines of the parameter
// bank (which starts 16 bytes into a line and is cold at each launch). The
// divisors fill the first line, the count (read at entry, with them) opens
// the second, so both lines are asked for at once; the reads indexed by
// q/k/v that follow the divisions then hit the second line, instead of
// waiting for a line of their own.
struct PackFlatPlan {
  FastDivmod by_row3, by_seg, by_local, by_rows;  // 3 * seg, seg, local heads, rows
  int32_t row_stride[3];   // bytes between token rows of q, k, v (plan_pack_flat: within int32)
  int32_t head_stride[3];  // bytes between heads of q, k, v
  int32_t total;           // 16-byte vectors in the output
  const unsigned char* src[3];
  unsigned char* out;
};
static_assert(sizeof(PackFlatPlan) == 112, "two lines of the parameter bank");
// False when the pack does not qualify (then plan_pack_qkv's engine runs).
bool plan_pack_flat(const PackQkvShape& shape, const TensorArg& q, const TensorArg& k, const TensorArg& v,
                    const TensorArg& out, PackFlatPlan& plan);
// Where output vector i (< plan.total) is read: tensor `which` (0 q, 1 k,
// 2 v), byte offset `from`. Shared by the kernel and the host tests.
ATTNPREP_HD void pack_flat_source(const PackFlatPlan& p, uint32_t i, int& which, int64_t& from) {
  const uint32_t row = p.by_row3.div(i);               // output row: (destination, token, local head)
  const uint32_t c = i - row * p.by_row3.divisor;      // vector within the row's q | k | v
  const uint32_t seg = p.by_seg.div(c);
  const uint32_t e = c - seg * p.by_seg.divisor;
  const uint32_t t = p.by_local.div(row);              // (destination, token)
  const uint32_t h = row - t * p.by_local.divisor;
  const uint32_t d = p.by_rows.div(t);
  const uint32_t r = t - d * p.by_rows.divisor;
  which = static_cast<int>(seg);
  from = int64_t{r} * p.row_stride[which] + (int64_t{d} * p.by_local.divisor + h) * p.head_stride[which] +
         int64_t{e} * 16;
}

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
