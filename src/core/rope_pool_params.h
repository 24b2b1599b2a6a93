// The parameter blocks of the rope kernels (rope_pool_fused's, then mla_rope_pool_fused's), shared verbatim by the
// host, the CUDA and the Metal kernels: fixed-width fields only, so C++ and Metal agree byte for byte (the
// static_asserts pin the layouts).
#pragma once

#if defined(__METAL_VERSION__)
#include <metal_stdlib>
typedef long ap_i64;
typedef int ap_i32;
#else
#include <cstddef>
#include <cstdint>
typedef int64_t ap_i64;
typedef int32_t ap_i32;
#endif

#define ATTNPREP_ROPE_MAX_HALF 256  // rotary_dim / 2 at most (head_dim <= 512)

// Strides in elements; "qo"/"ko" are q_rot/k_rot. A pool row is at page * stride_page + offset * stride_offset +
// head * stride_head for slot = page * page_size + offset (a flat pool: page_size 1, stride_offset 0).
struct RopePoolParams {
  ap_i64 num_tokens;
  ap_i64 pool_size;  // slots: pages * page_size
  ap_i64 page_size;
  ap_i64 q_stride_token, q_stride_head;
  ap_i64 k_stride_token, k_stride_head;
  ap_i64 v_stride_token, v_stride_head;
  ap_i64 qo_stride_token, qo_stride_head;
  ap_i64 ko_stride_token, ko_stride_head;
  ap_i64 kp_stride_page, kp_stride_offset, kp_stride_head;
  ap_i64 vp_stride_page, vp_stride_offset, vp_stride_head;
  ap_i64 cache_stride;                       // elements between rows of cos_sin_cache
  ap_i64 cache_len;                          // rows of cos_sin_cache (max_position)
  ap_i64 pos_stride_token, pos_stride_axis;  // positions [T] or [3, T] (M-RoPE): elements between entries
  ap_i64 slots_stride;
  ap_i32 num_qo_heads, num_kv_heads;
  ap_i32 head_dim, rotary_dim;
  ap_i32 is_neox;         // 1: rotate halves; 0: GPT-J interleaved pairs
  ap_i32 use_cache;       // 1: cos/sin from cos_sin_cache; 0: from inv_freq
  ap_i32 positions_kind;  // 0 int32, 1 int64, 2 none: token t's position is t (one cos_sin_cache row per token)
  ap_i32 slots_int64;
  ap_i32 cache_bf16;         // cos_sin_cache dtype: 1 bfloat16, 0 float32
  ap_i32 width;              // elements per memory access (1, or 16 bytes' worth)
  ap_i32 qk_items_per_head;  // work items of one q or k head (rotated + passed through)
  ap_i32 v_items_per_head;   // work items of one v head (copied): groups j and j + head_dim / (2 width)
                             // when head_dim / width is even (then this is half of it), else one group
  ap_i32 pool_fp8;           // pools: 0 q's dtype, 1 float8_e4m3fn, 2 float8_e5m2 (stored x / scale)
  ap_i32 k_scale_per_head;   // fp8: 1 k_scale has one entry per kv head, 0 one for all
  ap_i32 v_scale_per_head;
  ap_i32 norm_q, norm_k;          // 1: RMS-normalize each q (k) head over head_dim before the rotation
  ap_i32 q_norm_f32, k_norm_f32;  // norm weight dtype: 1 float32, 0 q's dtype
  ap_i32 norm_lanes;              // CUDA norm kernel: lanes per head (a power of two <= 32) ...
  ap_i32 norm_per_lane;           // ... each holding this many contiguous elements; the product is
                                  // head_dim rounded up to a power of two
  float norm_eps;                 // float32(norm_eps)
  float norm_offset;              // 0: weight * T(normalized) (Llama/Qwen3); else (offset + weight) * normalized
  ap_i32 cache_vector;            // 1: cos_sin_cache's rows and their sin halves start on 16-byte boundaries
  ap_i32 mrope;                   // 0: one position per token; 1 M-RoPE sections; 2 M-RoPE interleaved
  ap_i32 mrope_section[3];        // frequencies of the time, height and width axes
  ap_i32 q_fp8;                   // 1: q_rot is float8_e4m3fn, q_rot / q_scale (CUDA)
  ap_i32 pad0;                    // explicit: the block's size a multiple of 8 bytes on both sides
  float inv_freq[ATTNPREP_ROPE_MAX_HALF];  // float32(1 / base^(2i / rotary_dim)), used when !use_cache
};

// M-RoPE: the position axis (0 time, 1 height, 2 width) that rotates frequency i. Sections (Qwen2-VL, Qwen2.5-VL):
// consecutive blocks of mrope_section[j] frequencies; interleaved (Qwen3-VL): i % 3 == j for i < 3 * mrope_section[j].
#if defined(__CUDACC__)
__host__ __device__ __forceinline__
#else
inline
#endif
    int rope_mrope_axis(int kind, int s0, int s1, int s2, int i) {
  if (kind == 1) return i < s0 ? 0 : (i < s0 + s1 ? 1 : 2);
  const int r = i % 3;
  return (r == 1 && i < 3 * s1) ? 1 : ((r == 2 && i < 3 * s2) ? 2 : 0);
}

#if !defined(__METAL_VERSION__)
static_assert(sizeof(RopePoolParams) == 24 * 8 + 30 * 4 + ATTNPREP_ROPE_MAX_HALF * 4,
              "RopePoolParams layout must match the Metal side");
static_assert(offsetof(RopePoolParams, num_qo_heads) == 192, "layout");
static_assert(offsetof(RopePoolParams, width) == 228, "layout");
static_assert(offsetof(RopePoolParams, pool_fp8) == 240, "layout");
static_assert(offsetof(RopePoolParams, norm_q) == 252, "layout");
static_assert(offsetof(RopePoolParams, norm_eps) == 276, "layout");
static_assert(offsetof(RopePoolParams, inv_freq) == 312, "layout");
#endif

// mla_rope_pool_fused's block. The fields the rope kernels' cos/sin helpers read (use_cache, cache_stride,
// cache_bf16, rotary_dim) have RopePoolParams' names.
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
