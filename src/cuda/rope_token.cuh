// A token's place in the RoPE kernels: its position and slot, and where its
// heads' rows start in the k and v pools.
#pragma once

#include <cstdint>

#include "core/fast_divmod.h"
#include "core/rope_pool_params.h"
#include "cuda/rope_group.cuh"

namespace attnprep::cuda::rope {

// Token t's position and slot. A position outside cos_sin_cache must not be
// read: its rows become NaN and its pool write is skipped (check_slots=True
// reports it on the host); a slot outside [0, pool_size) is not written.
struct TokenPlace {
  int64_t pos, slot;
  int64_t pos_lo, pos_hi;  // M-RoPE: the smallest and largest of the token's three positions
  bool pos_ok, write_pool;
};
// read_token_place asks for them; check_token_place then uses them (a
// caller may issue other loads in between, which then do not wait for the
// position's round trip).
__device__ __forceinline__ TokenPlace read_token_place(const RopePoolParams& p, const RopePoolPointers& ptr,
                                                       int64_t t) {
  TokenPlace tp;
  tp.pos = p.positions_kind == 2 ? t : read_index(ptr.positions, t * p.pos_stride_token, p.positions_kind);
  tp.slot = p.pool_size > 0 ? read_index(ptr.slots, t * p.slots_stride, p.slots_int64) : -1;  // no pools: no slots
  tp.pos_lo = tp.pos_hi = tp.pos;
  if (p.mrope) {
    for (int axis = 1; axis < 3; ++axis) {
      const int64_t a = read_index(ptr.positions, axis * p.pos_stride_axis + t * p.pos_stride_token, p.positions_kind);
      tp.pos_lo = min(tp.pos_lo, a);
      tp.pos_hi = max(tp.pos_hi, a);
    }
  }
  return tp;
}
__device__ __forceinline__ TokenPlace check_token_place(const RopePoolParams& p, TokenPlace tp) {
  tp.pos_ok = !p.use_cache || (tp.pos_lo >= 0 && tp.pos_hi < p.cache_len);
  tp.write_pool = tp.pos_ok && tp.slot >= 0 && tp.slot < p.pool_size;
  return tp;
}
__device__ __forceinline__ TokenPlace token_place(const RopePoolParams& p, const RopePoolPointers& ptr, int64_t t) {
  return check_token_place(p, read_token_place(p, ptr, t));
}

// The position that rotates frequency i of token t: `pos` (its time-axis one), or with M-RoPE that of the
// frequency's axis (a second read of an L1-resident line).
__device__ __forceinline__ int64_t freq_position(const RopePoolParams& p, const RopePoolPointers& ptr, int64_t t,
                                                 int64_t pos, int i) {
  if (!p.mrope) return pos;
  const int axis = rope_mrope_axis(p.mrope, p.mrope_section[0], p.mrope_section[1], p.mrope_section[2], i);
  return axis == 0 ? pos
                   : read_index(ptr.positions, axis * p.pos_stride_axis + t * p.pos_stride_token, p.positions_kind);
}

// Where head `head` of slot `slot` starts in the v (is_v) or k pool, in elements: slot -> (page, offset) by a 32-bit
// multiply-shift (paged pools have < 2^32 slots), recomputed per item because holding it costs registers.
__device__ __forceinline__ int64_t pool_row(const RopePoolParams& p, const core::FastDivmod& page_div, int64_t slot,
                                            int head, bool is_v) {
  const int64_t page = p.page_size == 1 ? slot : static_cast<int64_t>(page_div.div_wide(static_cast<uint32_t>(slot)));
  const int64_t offset = slot - page * p.page_size;
  return is_v ? page * p.vp_stride_page + offset * p.vp_stride_offset + head * p.vp_stride_head
              : page * p.kp_stride_page + offset * p.kp_stride_offset + head * p.kp_stride_head;
}

// The dequantization scale of a head's fp8 pool row.
__device__ __forceinline__ float pool_scale(const RopePoolParams& p, const RopePoolPointers& ptr, int head, bool is_v) {
  return is_v ? ptr.v_scale[p.v_scale_per_head ? head : 0] : ptr.k_scale[p.k_scale_per_head ? head : 0];
}

// fp8 q_rot: the element a q_rot address located in T's units (q_rot + offset) stands for, in the float8 q_rot
// (offsets and strides count elements either way).
template <typename T>
__device__ __forceinline__ unsigned char* fp8_q_row(const RopePoolPointers& ptr, const T* dst) {
  return static_cast<unsigned char*>(ptr.q_rot) + (dst - static_cast<const T*>(ptr.q_rot));
}

}  // namespace attnprep::cuda::rope
