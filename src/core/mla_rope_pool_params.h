// The parameter block of mla_rope_pool_fused's kernels, shared verbatim by the host, the CUDA and the Metal kernel:
// fixed-width fields only (the static_asserts pin the layout). Field names the rope kernels' cos/sin helpers read
// (use_cache, cache_stride, cache_bf16, rotary_dim) are those of RopePoolParams.
#pragma once

#include "core/rope_pool_params.h"

// Strides in elements; "qo" is q_rot, "pe_out" k_pe_rot. Row s of a cache: page * stride_page + offset *
// stride_offset for slot = page * page_size + offset (an unpaged cache: page_size 1, stride_offset 0).
struct MlaRopeParams {
  ap_i64 num_tokens;
  ap_i64 cache_slots;  // pages * page_size
  ap_i64 page_size;
  ap_i64 q_stride_token, q_stride_head;
  ap_i64 qo_stride_token, qo_stride_head;
  ap_i64 kv_stride, pe_stride, pe_out_stride;  // rows of kv_c, k_pe, k_pe_rot
  ap_i64 kv_stride_page, kv_stride_offset;     // kv_cache (kv_c's L values of a row)
  ap_i64 kpe_stride_page, kpe_stride_offset;   // kpe_cache, or kv_cache's last R values of a row
  ap_i64 cache_stride, cache_len;              // cos_sin_cache: elements between rows, rows
  ap_i64 pos_stride, slots_stride;
  ap_i32 heads, q_dim;  // q [T, heads, q_dim]: q_dim - rotary_dim passed through, then rotary_dim rotated
  ap_i32 rotary_dim;    // R = k_pe.shape[1]
  ap_i32 kv_rank;       // L = kv_c.shape[1]
  ap_i32 is_neox;       // 1: rotate halves; 0: GPT-J pairs
  ap_i32 use_cache;     // 1: cos/sin from cos_sin_cache; 0: from inv_freq
  ap_i32 positions_int64, slots_int64;
  ap_i32 cache_bf16;   // cos_sin_cache dtype: 1 bfloat16, 0 float32
  ap_i32 width;        // elements per memory access (1, or 16 bytes' worth)
  ap_i32 cache_fp8;    // caches: 0 q's dtype, 1 float8_e4m3fn, 2 float8_e5m2 (stored x / cache_scale)
  ap_i32 q_fp8;        // 1: q_rot is float8_e4m3fn (q_rot / q_scale)
  ap_i32 inplace;      // 1: q_rot is q (only its rope part written), k_pe_rot is k_pe
  ap_i32 norm;         // 1: kv_c RMS-normalized with its weight
  ap_i32 norm_f32;     // weight dtype: 1 float32, 0 q's dtype
  ap_i32 norm_padded;  // L rounded up to a power of two: the pairwise sum's width
  float norm_eps;      // float32(norm_eps)
  ap_i32 pad0;         // explicit: the block's size a multiple of 8 bytes on both sides
  float inv_freq[ATTNPREP_ROPE_MAX_HALF];  // float32(1 / base^(2i / rotary_dim)), used when !use_cache
};

#if !defined(__METAL_VERSION__)
static_assert(sizeof(MlaRopeParams) == 18 * 8 + 18 * 4 + ATTNPREP_ROPE_MAX_HALF * 4,
              "MlaRopeParams layout must match the Metal side");
static_assert(offsetof(MlaRopeParams, heads) == 144, "layout");
static_assert(offsetof(MlaRopeParams, inv_freq) == 216, "layout");
#endif
