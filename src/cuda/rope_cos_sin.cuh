// cos/sin of the RoPE kernels: the rotation's arithmetic, a token's cos/sin
// from rope_base or from cos_sin_cache rows, the block's table, the warps'
// asynchronous row copies.
#pragma once

#include <cstdint>

#include "core/angle_sincos.h"
#include "core/rope_pool_params.h"
#include "cuda/rope_group.cuh"

namespace attnprep::cuda::rope {

// The rotation of a pair (a, b) by (cos, sin) = (r.x, r.y), in float32 with
// the multiply-adds spelled out (docs/contract.md): the first element, then
// the second.
__device__ __forceinline__ float rotate_first(float a, float b, float2 r) {
  return __fmaf_rn(a, r.x, -__fmul_rn(b, r.y));
}
__device__ __forceinline__ float rotate_second(float a, float b, float2 r) {
  return __fmaf_rn(b, r.x, __fmul_rn(a, r.y));
}

// (cos, sin) of frequency i at position pos: from rope_base, or read from cos_sin_cache (NaN for a position outside
// the table, which is never read). inv_freq_i is p.inv_freq[i], read by the caller (before the kernel's wait). P: a
// parameter block with RopePoolParams' table fields (RopePoolParams, MlaRopeParams).
template <typename P>
__device__ __forceinline__ float2 token_cos_sin(const P& p, const void* cos_sin_cache, int64_t pos, bool pos_ok, int i,
                                                float inv_freq_i) {
  float c, s;
  if (!p.use_cache) {
    // float32 angle; sin/cos from a double rounded once below 2^52, with
    // no slow path there (core/angle_sincos.h says why not sincosf)
    const float angle = __fmul_rn(static_cast<float>(pos), inv_freq_i);
    core::angle_sincos(angle, &s, &c);
  } else if (pos_ok) {
    const int half = p.rotary_dim / 2;
    const int64_t row = pos * p.cache_stride;
    if (p.cache_bf16) {
      const auto* cache = static_cast<const __nv_bfloat16*>(cos_sin_cache);
      c = __bfloat162float(cache[row + i]);
      s = __bfloat162float(cache[row + half + i]);
    } else {
      const auto* cache = static_cast<const float*>(cos_sin_cache);
      c = cache[row + i];
      s = cache[row + half + i];
    }
  } else {
    c = s = __int_as_float(0x7fc00000);
  }
  return make_float2(c, s);
}

// *a from global memory by a read-only load (kGlobal) or from shared memory.
template <bool kGlobal, typename V>
__device__ __forceinline__ V read_cos_sin(const V* a) {
  if constexpr (kGlobal)
    return __ldg(a);
  else
    return *a;
}

// N (cos, sin) pairs from float32 cosines at `cos` and sines at `sin`, 16
// bytes at a time where N allows (both then 16-byte aligned), from global
// memory (kGlobal, read-only loads) or from shared memory.
template <int N, bool kGlobal>
__device__ __forceinline__ void float32_cos_sin(const float* cos, const float* sin, float2 (&r)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 c = read_cos_sin<kGlobal>(reinterpret_cast<const float4*>(cos + i));
      const float4 s = read_cos_sin<kGlobal>(reinterpret_cast<const float4*>(sin + i));
      r[i] = make_float2(c.x, s.x);
      r[i + 1] = make_float2(c.y, s.y);
      r[i + 2] = make_float2(c.z, s.z);
      r[i + 3] = make_float2(c.w, s.w);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) r[i] = make_float2(read_cos_sin<kGlobal>(cos + i), read_cos_sin<kGlobal>(sin + i));
  }
}

// The block's cos/sin table in shared memory, laid out as a cos_sin_cache row (cosines, then sines from
// kTableSin): (cos, sin) pairs side by side made each 16-byte read of a warp span 512 bytes, a 4-way bank
// conflict; split, 256 bytes (2-way).
constexpr int kTableSin = ATTNPREP_ROPE_MAX_HALF;
template <int N>
__device__ __forceinline__ void table_cos_sin(const float* table, int freq, float2 (&r)[N]) {
  float32_cos_sin<N, false>(table + freq, table + kTableSin + freq, r);
}
__device__ __forceinline__ float2 table_cos_sin(const float* table, int freq) {
  return make_float2(table[freq], table[kTableSin + freq]);
}

// (cos, sin) of frequencies freq ... freq + N - 1 of a cos_sin_cache row, `at` at entry freq, 16 bytes at a time
// (float32) or 8 (bfloat16), from global memory (kGlobal) or a warp's shared-memory copy.
template <int N, bool kGlobal>
__device__ __forceinline__ void cos_sin_at(const RopePoolParams& p, const void* at, float2 (&r)[N]) {
  static_assert(N % 4 == 0, "16-byte reads of float32 rows, 8-byte reads of bfloat16 rows");
  const int half = p.rotary_dim / 2;
  if (p.cache_bf16) {
    const auto* cache = static_cast<const unsigned short*>(at);
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const uint2 c = read_cos_sin<kGlobal>(reinterpret_cast<const uint2*>(cache + i));
      const uint2 s = read_cos_sin<kGlobal>(reinterpret_cast<const uint2*>(cache + half + i));
      // bfloat16 -> float32: the high half of the word
      r[i] = make_float2(__uint_as_float(c.x << 16), __uint_as_float(s.x << 16));
      r[i + 1] = make_float2(__uint_as_float(c.x & 0xffff0000u), __uint_as_float(s.x & 0xffff0000u));
      r[i + 2] = make_float2(__uint_as_float(c.y << 16), __uint_as_float(s.y << 16));
      r[i + 3] = make_float2(__uint_as_float(c.y & 0xffff0000u), __uint_as_float(s.y & 0xffff0000u));
    }
  } else {
    const float* cache = static_cast<const float*>(at);
    float32_cos_sin<N, kGlobal>(cache, cache + half, r);
  }
}

// The same straight from the token's row in global memory (p.cache_vector): each warp reads its own frequencies, so
// no block-wide table and barrier stand between the position and the first rotation.
template <int N>
__device__ __forceinline__ void row_cos_sin(const RopePoolParams& p, const RopePoolPointers& ptr, int64_t pos,
                                            bool pos_ok, int freq, float2 (&r)[N]) {
  if (!pos_ok) {
#pragma unroll
    for (int i = 0; i < N; ++i) r[i] = make_float2(__int_as_float(0x7fc00000), __int_as_float(0x7fc00000));
    return;
  }
  const int elem = p.cache_bf16 ? 2 : 4;
  cos_sin_at<N, true>(p, static_cast<const char*>(ptr.cos_sin_cache) + (pos * p.cache_stride + freq) * elem, r);
}

// Asks L1 for the token's cos_sin_cache row lines as soon as the position is known: a new position's row is usually
// in DRAM and is read only after the item's loads, so its round trip would add to every block's first round.
__device__ __forceinline__ void prefetch_row_cos_sin(const RopePoolParams& p, const RopePoolPointers& ptr, int64_t pos,
                                                     int freq) {
  const int elem = p.cache_bf16 ? 2 : 4;
  const char* row = static_cast<const char*>(ptr.cos_sin_cache) + (pos * p.cache_stride + freq) * elem;
  asm volatile("prefetch.global.L1 [%0];\n" ::"l"(row));
  asm volatile("prefetch.global.L1 [%0];\n" ::"l"(row + (p.rotary_dim / 2) * elem));
}

// Asynchronous copies global -> shared (cp.async): no registers held in flight; readable by the copying thread after
// wait_async_copies(), by others after a barrier following it (warp_rows_ready).
__device__ __forceinline__ void copy_async(void* smem, const void* gmem, int bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if (bytes == 16)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(gmem));
}
// The same for 16 bytes read once (cached in L2 only).
__device__ __forceinline__ void copy_async_streaming(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void commit_async_copies() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void wait_async_copies() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// Waits until at most `kPending` of the thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void wait_async_copies_but() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Warp rows: each warp's shared-memory copy of the token's cos_sin_cache row and the 2-byte norm weights, copied
// asynchronously by its lanes; lanes reading the same frequencies read the same bytes (one access where a copy per
// thread took four), and the copies hold no registers in flight. Host and device: the launcher sizes it.
struct WarpRows {
  int row_chunks, weight_chunks;  // 16-byte chunks: the row, one tensor's weights
  __host__ __device__ __forceinline__ explicit WarpRows(const RopePoolParams& p)
      : row_chunks(p.rotary_dim * (p.cache_bf16 ? 2 : 4) / 16), weight_chunks(p.head_dim * 2 / 16) {}
  __host__ __device__ __forceinline__ int chunks() const { return row_chunks + 2 * weight_chunks; }
  __host__ __device__ __forceinline__ int bytes() const { return 16 * chunks(); }
};

// The weights' copies, by the warp's lanes; a tensor whose weights are not
// 2-byte is not copied (its items read it from global memory).
__device__ __forceinline__ void copy_warp_weights(const RopePoolPointers& ptr, const WarpRows& rows, uint4* area,
                                                  bool copy_q, bool copy_k, int lane) {
#pragma unroll 1
  for (int c = lane; c < 2 * rows.weight_chunks; c += 32) {
    const bool k = c >= rows.weight_chunks;
    if (k ? copy_k : copy_q)
      copy_async(
          area + rows.row_chunks + c,
          static_cast<const uint4*>(k ? ptr.k_norm_weight : ptr.q_norm_weight) + (c - (k ? rows.weight_chunks : 0)),
          16);
  }
}
// The row's copies, by the warp's lanes (NaN for a position outside the
// table, stored directly: that row is never read).
__device__ __forceinline__ void copy_warp_row(const RopePoolParams& p, const RopePoolPointers& ptr,
                                              const WarpRows& rows, uint4* area, int64_t pos, bool pos_ok, int lane) {
  const int elem = p.cache_bf16 ? 2 : 4;
  const uint4* row = reinterpret_cast<const uint4*>(static_cast<const char*>(ptr.cos_sin_cache) +
                                                    (pos_ok ? pos : 0) * p.cache_stride * elem);
#pragma unroll 1
  for (int c = lane; c < rows.row_chunks; c += 32) {
    if (pos_ok)
      copy_async(area + c, row + c, 16);
    else
      area[c] = make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u);  // NaN as float32 and as bfloat16
  }
}
// Before a warp's items read its rows: the lane's own copies landed, then
// every lane's (the warp's lanes all call it).
__device__ __forceinline__ void warp_rows_ready() {
  wait_async_copies();
  __syncwarp();
}

}  // namespace attnprep::cuda::rope
