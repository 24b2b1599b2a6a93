// pack_qkv_destination_major: the checks of docs/contract.md, in order, and
// the copy plan that packs q, k and v destination-major in one launch.
#pragma once

#include <cstdint>

#include "core/strided_copy.h"
#include "core/tensor.h"

namespace attnprep::core {

struct PackQkvShape {
  int64_t world_size, rows, global_heads, local_heads, head_size;
  bool fits;  // the output spans at most 2^63 - 1 bytes (core::fits_int64_bytes)
  // [world_size, rows, local_heads, 3 * head_size]; -1s where it does not fit
  int64_t out_shape[4];
};

// Runs checks 1-5 (q, k, v, world_size). Checks 6-7 need the output and run in
// check_pack_qkv_out, so the bindings can allocate the output in between.
PackQkvShape check_pack_qkv_inputs(const TensorArg& q, const TensorArg& k, const TensorArg& v, int64_t world_size);

// Checks 6 and 7: `out` is contiguous with the expected shape, device and
// dtype, and shares no byte with q, k or v.
void check_pack_qkv_out(const PackQkvShape& shape, const TensorArg& q, const TensorArg& k, const TensorArg& v,
                        const TensorArg& out);

// Check 8, before the output is allocated (out=None): it fits in int64 bytes.
void check_pack_qkv_output_size(const PackQkvShape& shape);

// The three copy jobs (q, k, v into their thirds of each output row).
StridedCopyPlan plan_pack_qkv(const PackQkvShape& shape, const TensorArg& q, const TensorArg& k, const TensorArg& v,
                              const TensorArg& out);

// A pack of 16-byte rows and strides under 2^31 vectors as one flat run, one vector per thread: small packs walk
// the output in order, large ones the inputs (as Inductor's kernel does). 112 bytes on two 64-byte lines of the
// parameter bank, the divisors and the count read together at entry (one cold line each, asked for at once).
struct PackFlatPlan {
  // 3 * seg, seg, local heads; then rows (output order) or world (input order)
  FastDivmod by_row3, by_seg, by_local, by_inner;
  int32_t row_stride[3];   // bytes between token rows of q, k, v (plan_pack_flat: within int32)
  int32_t head_stride[3];  // bytes between heads of q, k, v
  int32_t total;           // 16-byte vectors in the output
  int32_t rows;            // token rows (the input-order walk's output place)
  const unsigned char* src[3];
  unsigned char* out;
};
static_assert(sizeof(PackFlatPlan) == 112, "two lines of the parameter bank");
// False when the pack does not qualify (then plan_pack_qkv's engine runs).
bool plan_pack_flat(const PackQkvShape& shape, const TensorArg& q, const TensorArg& k, const TensorArg& v,
                    const TensorArg& out, PackFlatPlan& plan);
// Whether a flat pack of `total` vectors walks its inputs in order (at and
// above CopyCudaPolicy::small_below vectors) rather than its output.
inline bool pack_flat_walks_inputs(int64_t total) { return total >= CopyCudaPolicy::small_below; }
// Step i (< plan.total) of the walk in input order (kInputOrder) or output
// order: the vector read from tensor `which` (0 q, 1 k, 2 v) at byte offset
// `from` goes to output vector `to`. Shared by the kernel and the host tests.
template <bool kInputOrder>
ATTNPREP_HD void pack_flat_step(const PackFlatPlan& p, uint32_t i, int& which, int64_t& from, uint32_t& to) {
  const uint32_t row = p.by_row3.div(i);           // (t, local head)
  const uint32_t c = i - row * p.by_row3.divisor;  // vector within the row's q | k | v
  const uint32_t seg = p.by_seg.div(c);
  const uint32_t e = c - seg * p.by_seg.divisor;
  const uint32_t t = p.by_local.div(row);  // (destination, token) or (token, destination)
  const uint32_t h = row - t * p.by_local.divisor;
  const uint32_t outer = p.by_inner.div(t);
  const uint32_t inner = t - outer * p.by_inner.divisor;
  const uint32_t d = kInputOrder ? inner : outer;
  const uint32_t r = kInputOrder ? outer : inner;
  which = static_cast<int>(seg);
  from =
      int64_t{r} * p.row_stride[which] + (int64_t{d} * p.by_local.divisor + h) * p.head_stride[which] + int64_t{e} * 16;
  // under total < 2^31
  to = kInputOrder ? ((d * static_cast<uint32_t>(p.rows) + r) * p.by_local.divisor + h) * p.by_row3.divisor + c : i;
}

// The Ulysses layer's grouped pack (GQA, and chunked MHA): [chunks, world_size, rows, (chunk_q + 2 * chunk_kv) * D],
// chunk c of destination d its q heads, then the kv heads they use, then the same v heads (one contiguous send
// buffer per chunk; kv_heads < world_size: the one kv head, replicated).
struct PackGqaShape {
  int64_t world_size, rows, heads, kv_heads, head_size, local_q, local_kv, chunks, chunk_q, chunk_kv;
  int64_t batch;  // [S, B, H, D] inputs: B (rows = S * B, in (s, b) order); 0 for [rows, H, D]
  int64_t out_shape[4];
};
// The head geometry alone (any device): shared with the layer's CPU path.
void check_ulysses_geometry(const TensorArg& q, const TensorArg& k, const TensorArg& v, int64_t world_size);
// The layer's checks of batched inputs, q [B, rows, H, D], k and v [B, rows, H_kv, D], and the optional
// key-padding mask [B, rows] (null: none); any world size (heads are padded to it).
void check_ulysses_batched(const TensorArg& q, const TensorArg& k, const TensorArg& v, const TensorArg* mask);
// The geometry, then: a CUDA device, unit stride in head_dim, and `chunks`
// dividing the local q heads (and the local kv heads when they are split). Also takes [S, B, H, D] inputs whose
// rows are (s, b), row-major (the batched layer's, so that its receive buffer views as whole sequences), one chunk.
PackGqaShape check_pack_qkv_gqa(const TensorArg& q, const TensorArg& k, const TensorArg& v, int64_t world_size,
                                int64_t chunks = 1);
StridedCopyPlan plan_pack_qkv_gqa(const PackGqaShape& shape, const TensorArg& q, const TensorArg& k, const TensorArg& v,
                                  const TensorArg& out);
// Whether `chunks` divides the heads of every chunk as above (any device).
void check_ulysses_chunks(int64_t local_q, int64_t local_kv, bool kv_split, int64_t chunks);

}  // namespace attnprep::core
