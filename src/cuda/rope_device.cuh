// Device helpers of the fused RoPE + KV-pool kernels (cuda/rope_pool.cu and
// cuda/rope_norm_pool.cu): vector groups, the fp8 store, asynchronous copies,
// the rotation's arithmetic and the token's cos/sin.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "core/angle_sincos.h"
#include "core/fast_divmod.h"
#include "core/fp8_quotient.h"
#include "core/rope_pool.h"
#include "core/rope_pool_params.h"
#include "cuda/copy_loads.cuh"
#include "cuda/elements.cuh"
#include "cuda/rcp_sqrt.cuh"
#include "cuda/rope_pool.h"

namespace attnprep::cuda::rope {

using elements::from_float;
using elements::from_float2;
using elements::to_float;
using elements::to_float2;

// N consecutive elements, moved with one 16-byte access when N elements are
// 16 bytes (the plan guarantees alignment then), else one element at a time.
// kEvictLast: a 16-byte load carries an L2 evict-last policy
// (core::RopeCudaPolicy::several_round_loads_evict_last).
template <typename T, int N>
struct Group {
  static constexpr bool kVector = N * sizeof(T) == 16;
  T e[N];
  template <bool kEvictLast = false>
  __device__ __forceinline__ void load(const T* p) {
    if constexpr (kVector) {
      *reinterpret_cast<uint4*>(e) = ::attnprep::cuda::load<uint4, kEvictLast>(reinterpret_cast<const uint4*>(p));
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) e[i] = p[i];
    }
  }
  __device__ __forceinline__ void store(T* p) const {
    if constexpr (kVector) {
      *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(e);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) p[i] = e[i];
    }
  }
  // elements 2j and 2j + 1 as float32, and set from float32 (N even)
  __device__ __forceinline__ float2 get2(int j) const { return to_float2(e + 2 * j); }
  __device__ __forceinline__ void set2(int j, float a, float b) { from_float2(e + 2 * j, a, b); }
};

// N elements of a group, each x / scale (core::Fp8Quotient: the IEEE
// quotient) rounded to nearest even and saturated to the format's finite
// range, stored as N bytes (one access when N > 1: the plan aligns fp8 pool
// rows to the group size). Pairs convert in one instruction.
template <typename T, int N, typename Quotient>
__device__ __forceinline__ void store_fp8_with(const Group<T, N>& g, unsigned char* dst, Quotient quotient, int kind) {
  const __nv_fp8_interpretation_t fmt = kind == 1 ? __NV_E4M3 : __NV_E5M2;
  // packed in registers, four bytes to a word (a local byte array would go to the stack)
  uint32_t word[(N + 3) / 4] = {};
  if constexpr (N % 2 == 0) {
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      const float2 x = g.get2(j);
      const uint32_t b2 = __nv_cvt_float2_to_fp8x2(make_float2(quotient(x.x), quotient(x.y)), __NV_SATFINITE, fmt);
      word[j / 2] |= b2 << (16 * (j % 2));
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const uint32_t b = __nv_cvt_float_to_fp8(quotient(to_float(g.e[i])), __NV_SATFINITE, fmt);
      word[i / 4] |= b << (8 * (i % 4));
    }
  }
  if constexpr (N == 8) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(word[0], word[1]);
  } else if constexpr (N == 4) {
    *reinterpret_cast<uint32_t*>(dst) = word[0];
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = static_cast<unsigned char>(word[i / 4] >> (8 * (i % 4)));
  }
}
// The quotient's path chosen once for the group, not per value.
template <typename T, int N>
__device__ __forceinline__ void store_fp8(const Group<T, N>& g, unsigned char* dst, const core::Fp8Quotient& q,
                                          int kind) {
  if (q.fast)
    store_fp8_with(g, dst, [&](float x) { return q.by_reciprocal(x); }, kind);
  else
    store_fp8_with(g, dst, [&](float x) { return q.by_division(x); }, kind);
}

__device__ __forceinline__ int64_t read_index(const void* p, int64_t i, int is64) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// A float of the kernel's __grid_constant__ parameter block read through its
// generic address: a warp's 32 consecutive floats then take one coalesced
// load, where an indexed read of the parameter bank (LDC) serves the warp's
// addresses one at a time. Volatile: it stays where it is written.
__device__ __forceinline__ float read_param_float(const float* a) {
  float v;
  asm volatile("ld.f32 %0, [%1];" : "=f"(v) : "l"(a));
  return v;
}

// The rotation of a pair (a, b) by (cos, sin) = (r.x, r.y), in float32 with
// the multiply-adds spelled out (docs/contract.md): the first element, then
// the second.
__device__ __forceinline__ float rotate_first(float a, float b, float2 r) {
  return __fmaf_rn(a, r.x, -__fmul_rn(b, r.y));
}
__device__ __forceinline__ float rotate_second(float a, float b, float2 r) {
  return __fmaf_rn(b, r.x, __fmul_rn(a, r.y));
}

// (cos, sin) of frequency i at position pos: from rope_base, or read from
// cos_sin_cache (NaN for a position outside the table, which is never read).
// inv_freq_i is p.inv_freq[i], read by the caller (before the kernel's wait).
__device__ __forceinline__ float2 token_cos_sin(const RopePoolParams& p, const RopePoolPointers& ptr, int64_t pos,
                                                bool pos_ok, int i, float inv_freq_i) {
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
      const auto* cache = static_cast<const __nv_bfloat16*>(ptr.cos_sin_cache);
      c = __bfloat162float(cache[row + i]);
      s = __bfloat162float(cache[row + half + i]);
    } else {
      const auto* cache = static_cast<const float*>(ptr.cos_sin_cache);
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
  if constexpr (kGlobal) return __ldg(a);
  else return *a;
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

// The block's cos/sin table in shared memory (the rotation kernel's, where
// cos/sin are not read from cos_sin_cache rows): the cosines of frequencies
// 0 ... rotary_dim / 2 - 1 at [0, kTableSin), their sines from kTableSin, as
// a cos_sin_cache row is laid out. In the common shape at head_dim 128 a
// warp's items read eight consecutive frequencies each, at eight offsets: as
// (cos, sin) pairs side by side each of the four 16-byte reads spanned 512
// bytes, a 4-way bank conflict (16 shared-memory wavefronts for the warp
// where 4 carry the bytes, ncu), split each spans 256 bytes (2-way).
constexpr int kTableSin = ATTNPREP_ROPE_MAX_HALF;
template <int N>
__device__ __forceinline__ void table_cos_sin(const float* table, int freq, float2 (&r)[N]) {
  float32_cos_sin<N, false>(table + freq, table + kTableSin + freq, r);
}
__device__ __forceinline__ float2 table_cos_sin(const float* table, int freq) {
  return make_float2(table[freq], table[kTableSin + freq]);
}

// (cos, sin) of frequencies freq ... freq + N - 1 of a cos_sin_cache row
// (cos, then sin: the row's first rotary_dim entries), `at` pointing at its
// entry freq, 16 bytes at a time (float32) or 8 (bfloat16): from global
// memory (kGlobal, read-only loads) or from a warp's copy in shared memory.
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

// The same straight from the token's row in global memory (p.cache_vector;
// freq a multiple of N): the values token_cos_sin gives. Each warp then
// reads its own frequencies and no block-wide table (with its barrier)
// stands between the position and the first rotation.
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

// Asks L1 for the lines of the token's cos_sin_cache row that row_cos_sin
// will read for frequencies freq ... (cos and sin), as soon as the position
// is known: the row of a new position is usually in DRAM, and the read itself
// comes only after the item's loads (and its norm), so without this its round
// trip adds to every block's first round, and to the kernel's last wave.
__device__ __forceinline__ void prefetch_row_cos_sin(const RopePoolParams& p, const RopePoolPointers& ptr,
                                                     int64_t pos, int freq) {
  const int elem = p.cache_bf16 ? 2 : 4;
  const char* row = static_cast<const char*>(ptr.cos_sin_cache) + (pos * p.cache_stride + freq) * elem;
  asm volatile("prefetch.global.L1 [%0];\n" ::"l"(row));
  asm volatile("prefetch.global.L1 [%0];\n" ::"l"(row + (p.rotary_dim / 2) * elem));
}

// Asynchronous copies global -> shared (cp.async, through L1): the bytes
// land in shared memory without holding registers while they travel; the
// copying thread may read them after wait_async_copies(), others after a
// barrier that follows it (warp_rows_ready).
__device__ __forceinline__ void copy_async(void* smem, const void* gmem, int bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if (bytes == 16) asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
  else asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void commit_async_copies() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void wait_async_copies() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Warp rows (core::RopeCudaPolicy::norm_stage_max_blocks_per_sm): each warp's copy, in
// shared memory, of the token's cos_sin_cache row (its rotary_dim entries)
// and of the 2-byte norm weights (q's, then k's), copied asynchronously by
// the warp's lanes, 16 bytes each, as soon as their addresses are known.
// A warp's items then read their cos/sin and weights there; the lanes that
// read the same frequencies read the same bytes, one shared-memory access for
// the warp where a copy per thread took four, and the copies hold no
// registers while they travel.
// (Host and device: the launcher sizes the dynamic shared memory with it.)
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
      copy_async(area + rows.row_chunks + c,
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
    if (pos_ok) copy_async(area + c, row + c, 16);
    else area[c] = make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u);  // NaN as float32 and as bfloat16
  }
}
// Before a warp's items read its rows: the lane's own copies landed, then
// every lane's (the warp's lanes all call it).
__device__ __forceinline__ void warp_rows_ready() {
  wait_async_copies();
  __syncwarp();
}

// Token t's position and slot. A position outside cos_sin_cache must not be
// read: its rows become NaN and its pool write is skipped (check_slots=True
// reports it on the host); a slot outside [0, pool_size) is not written.
struct TokenPlace {
  int64_t pos, slot;
  bool pos_ok, write_pool;
};
// read_token_place asks for them; check_token_place then uses them (a
// caller may issue other loads in between, which then do not wait for the
// position's round trip).
__device__ __forceinline__ TokenPlace read_token_place(const RopePoolParams& p, const RopePoolPointers& ptr,
                                                       int64_t t) {
  TokenPlace tp;
  tp.pos = read_index(ptr.positions, t, p.positions_int64);
  tp.slot = read_index(ptr.slots, t, p.slots_int64);
  return tp;
}
__device__ __forceinline__ TokenPlace check_token_place(const RopePoolParams& p, TokenPlace tp) {
  tp.pos_ok = !p.use_cache || (tp.pos >= 0 && tp.pos < p.cache_len);
  tp.write_pool = tp.pos_ok && tp.slot >= 0 && tp.slot < p.pool_size;
  return tp;
}
__device__ __forceinline__ TokenPlace token_place(const RopePoolParams& p, const RopePoolPointers& ptr, int64_t t) {
  return check_token_place(p, read_token_place(p, ptr, t));
}

// Where head `head` of slot `slot` starts in the v pool (is_v) or the k pool,
// in elements. slot -> (page, offset) is a 32-bit multiply-shift division by
// page_size (`page`, core::RopeCudaIndex), as paged pools have fewer than
// 2^32 slots (checked); callers recompute it per item rather than hold it,
// which would cost registers.
__device__ __forceinline__ int64_t pool_row(const RopePoolParams& p, const core::FastDivmod& page_div, int64_t slot,
                                            int head, bool is_v) {
  const int64_t page = p.page_size == 1 ? slot
                                        : static_cast<int64_t>(page_div.div_wide(static_cast<uint32_t>(slot)));
  const int64_t offset = slot - page * p.page_size;
  return is_v ? page * p.vp_stride_page + offset * p.vp_stride_offset + head * p.vp_stride_head
              : page * p.kp_stride_page + offset * p.kp_stride_offset + head * p.kp_stride_head;
}

// The dequantization scale of a head's fp8 pool row.
__device__ __forceinline__ float pool_scale(const RopePoolParams& p, const RopePoolPointers& ptr, int head,
                                            bool is_v) {
  return is_v ? ptr.v_scale[p.v_scale_per_head ? head : 0] : ptr.k_scale[p.k_scale_per_head ? head : 0];
}

// ---- the QK norm (docs/contract.md), shared by both kernels that do it

// Where the norm weights sit in shared memory: q's at 0, k's at this offset.
constexpr int kNormWeightsK = 2 * ATTNPREP_ROPE_MAX_HALF;

// How a normalized value meets its weight (docs/contract.md): Llama/Qwen3
// (norm_weight_offset 0) round x inv to T first, then T(that * w); Gemma
// (any other offset) T((x inv) * (offset + w)), offset + w rounded once.
enum NormMode : int { kNoNorm = 0, kNormRoundThenWeight = 1, kNormOffsetWeight = 2 };

__host__ __device__ __forceinline__ NormMode norm_mode(const RopePoolParams& p) {
  return p.norm_offset == 0.f ? kNormRoundThenWeight : kNormOffsetWeight;
}

// The block's norm weights as float32 in shared memory (q's at w[i], k's at
// w[kNormWeightsK + i]; 1 where a side has no norm, offset + w where the
// offset is not 0), staged around the cos/sin table: start_norm_weights asks
// for the thread's first weights before the table, finish_norm_weights
// stores them after it and stages the rest, and the caller's barrier
// publishes them. Their round trip then overlaps the position's and the
// table's work (converted where loaded, a thread waited there for the q
// weight before it even asked for the k weight).
struct NormWeightBits {  // one element's weights as loaded: float32 bits, or T's in the low half
  uint32_t q = 0, k = 0;
};

template <typename T>
__device__ __forceinline__ uint32_t load_weight_bits(const void* w, bool f32, int i) {
  if (sizeof(T) == 4 || f32) return __ldg(static_cast<const unsigned int*>(w) + i);
  return __ldg(static_cast<const unsigned short*>(w) + i);
}

template <typename T>
__device__ __forceinline__ NormWeightBits load_norm_weights(const RopePoolParams& p, const RopePoolPointers& ptr,
                                                            int i) {
  NormWeightBits b;
  if (p.norm_q) b.q = load_weight_bits<T>(ptr.q_norm_weight, p.q_norm_f32, i);
  if (p.norm_k) b.k = load_weight_bits<T>(ptr.k_norm_weight, p.k_norm_f32, i);
  return b;
}

template <typename T>
__device__ __forceinline__ float staged_weight(uint32_t bits, bool on, bool f32, float offset) {
  if (!on) return 1.f;
  float w;
  if constexpr (sizeof(T) == 4) {
    w = __uint_as_float(bits);
  } else if constexpr (std::is_same_v<T, __half>) {
    w = f32 ? __uint_as_float(bits) : __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  } else {
    w = f32 ? __uint_as_float(bits) : __uint_as_float(bits << 16);  // bfloat16: the high half of a float32
  }
  return offset == 0.f ? w : __fadd_rn(offset, w);
}

// raw_q / raw_k: that section holds the 2-byte weights as loaded, in T (for
// one paired multiply, normalize_round_then_t_weight), not as float32.
template <typename T>
__device__ __forceinline__ void store_norm_weights(float* w, const RopePoolParams& p, int i, NormWeightBits b,
                                                   bool raw_q, bool raw_k) {
  if (raw_q) reinterpret_cast<unsigned short*>(w)[i] = static_cast<unsigned short>(b.q);
  else w[i] = staged_weight<T>(b.q, p.norm_q, p.q_norm_f32, p.norm_offset);
  if (raw_k) reinterpret_cast<unsigned short*>(w + kNormWeightsK)[i] = static_cast<unsigned short>(b.k);
  else w[kNormWeightsK + i] = staged_weight<T>(b.k, p.norm_k, p.k_norm_f32, p.norm_offset);
}

// The staging threads: thread `first` stages elements first, first + stride,
// ... (by default the block's threads, each from its own index).
template <typename T>
__device__ __forceinline__ NormWeightBits start_norm_weights(const RopePoolParams& p, const RopePoolPointers& ptr,
                                                             int first = static_cast<int>(threadIdx.x)) {
  return first < p.head_dim ? load_norm_weights<T>(p, ptr, first) : NormWeightBits{};
}

template <typename T>
__device__ __forceinline__ void finish_norm_weights(float* w, const RopePoolParams& p, const RopePoolPointers& ptr,
                                                    NormWeightBits first_bits, bool raw_q = false, bool raw_k = false,
                                                    int first = static_cast<int>(threadIdx.x),
                                                    int stride = static_cast<int>(blockDim.x)) {
  int i = first;
  if (i < p.head_dim) store_norm_weights<T>(w, p, i, first_bits, raw_q, raw_k);
  for (i += stride; i < p.head_dim; i += stride)
    store_norm_weights<T>(w, p, i, load_norm_weights<T>(p, ptr, i), raw_q, raw_k);
}

// The squares of a group's N elements summed pairwise (adjacent elements,
// then adjacent sums): one complete subtree of the contract's sum order.
template <typename T, int N>
__device__ __forceinline__ float group_squares(const Group<T, N>& g) {
  float s[N];
  if constexpr (N % 2 == 0) {
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      const float2 f = g.get2(j);
      s[2 * j] = __fmul_rn(f.x, f.x);
      s[2 * j + 1] = __fmul_rn(f.y, f.y);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float f = to_float(g.e[i]);
      s[i] = __fmul_rn(f, f);
    }
  }
#pragma unroll
  for (int step = 1; step < N; step *= 2)
#pragma unroll
    for (int i = 0; i < N; i += 2 * step) s[i] = __fadd_rn(s[i], s[i + step]);
  return s[0];
}

// 1 / sqrt(ss / head_dim + eps), each step correctly rounded (the root and
// the reciprocal: rcp_sqrt_rn).
__device__ __forceinline__ float norm_factor(float ss, const RopePoolParams& p) {
  return rcp_sqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(p.head_dim)), p.norm_eps));
}
// The same where head_dim is a power of two: ss / head_dim is then exactly
// ss * inv_head_dim (both are ss 2^-k correctly rounded), a multiply instead
// of a division per item.
__device__ __forceinline__ float norm_factor_pow2(float ss, float inv_head_dim, const RopePoolParams& p) {
  return rcp_sqrt_rn(__fadd_rn(__fmul_rn(ss, inv_head_dim), p.norm_eps));
}
// 1 / head_dim for head_dim a power of two 2^k: 2^-k, built from its exponent
// bits (exact, and no division between the butterfly and the root).
__device__ __forceinline__ float inv_pow2(int head_dim) {
  return __int_as_float((127 - (31 - __clz(head_dim))) << 23);
}

// x inv rounded to T and back (kNormRoundThenWeight), for a pair.
template <typename T>
__device__ __forceinline__ float2 round_through(float a, float b) {
  T pair[2];
  from_float2(pair, a, b);
  return to_float2(pair);
}

// A group normalized in place; weight(i) gives its element i's float32
// weight (staged_weight's value). kMode: how the weight applies (NormMode).
// The mode is a template parameter: as a run-time select per element both
// ways were issued.
template <int kMode, typename T, int N, typename Weight>
__device__ __forceinline__ void normalize_with(Group<T, N>& g, Weight weight, float inv) {
  if constexpr (N % 2 == 0) {
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      const float2 x = g.get2(j);
      float2 n = make_float2(__fmul_rn(x.x, inv), __fmul_rn(x.y, inv));
      if constexpr (kMode == kNormRoundThenWeight) n = round_through<T>(n.x, n.y);
      g.set2(j, __fmul_rn(n.x, weight(2 * j)), __fmul_rn(n.y, weight(2 * j + 1)));
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      float n = __fmul_rn(to_float(g.e[i]), inv);
      if constexpr (kMode == kNormRoundThenWeight) n = to_float(from_float<T>(n));
      g.e[i] = from_float<T>(__fmul_rn(n, weight(i)));
    }
  }
}

// The same with the weights staged in shared memory: w points at the
// group's first (store_norm_weights; 16-byte aligned when N is a multiple of
// 4, as a group's first element is a multiple of N, so they load four at a
// time).
template <int kMode, typename T, int N>
__device__ __forceinline__ void normalize_group(Group<T, N>& g, const float* w, float inv) {
  float wv[N];
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) *reinterpret_cast<float4*>(wv + i) = *reinterpret_cast<const float4*>(w + i);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) wv[i] = w[i];
  }
  normalize_with<kMode>(g, [&](int i) { return wv[i]; }, inv);
}

// The weights of elements off ... off + N - 1 of a q (or k: is_k) head as
// staged_weight gives them, read straight from the weight tensor, 16 bytes
// at a time (the launcher checks its alignment; off is a multiple of N, N of
// 4 for float32 weights and of 8 for 2-byte ones). Each warp reads its own
// (from L1 after the first), so no block-wide staging and no barrier.
template <int kMode, typename T, int N>
__device__ __forceinline__ void row_norm_weights(const RopePoolParams& p, const RopePoolPointers& ptr, bool is_k,
                                                 int off, float (&wv)[N]) {
  const void* w = is_k ? ptr.k_norm_weight : ptr.q_norm_weight;
  if (sizeof(T) == 4 || (is_k ? p.k_norm_f32 : p.q_norm_f32)) {
    static_assert(N % 4 == 0, "16-byte reads");
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(w) + off + i));
      wv[i] = v.x;
      wv[i + 1] = v.y;
      wv[i + 2] = v.z;
      wv[i + 3] = v.w;
    }
  } else if constexpr (sizeof(T) == 2) {
    static_assert(N % 8 == 0, "16-byte reads");
#pragma unroll
    for (int i = 0; i < N; i += 8) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(w) + off + i));
      const uint32_t word[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = to_float2(reinterpret_cast<const T*>(&word[j]));
        wv[i + 2 * j] = f.x;
        wv[i + 2 * j + 1] = f.y;
      }
    }
  }
  if constexpr (kMode == kNormOffsetWeight) {
#pragma unroll
    for (int i = 0; i < N; ++i) wv[i] = __fadd_rn(p.norm_offset, wv[i]);
  }
}

// kNormRoundThenWeight with 2-byte weights in T, `w` the group's weights as
// loaded from the weight tensor: T(float32(T(x inv)) * w) is
// the product of two T values rounded once to T (their float32 product is
// exact, or for bfloat16 below float32's normal range so small that both
// roundings give zero), which one paired T multiply computes. The weights
// then stay as loaded: a multiply per pair instead of unpacking the weight
// and the rounded value, two float32 multiplies and a repack.
template <typename T, int N>
__device__ __forceinline__ void normalize_round_then_t_weight(Group<T, N>& g, const Group<T, N>& w, float inv) {
  static_assert(sizeof(T) == 2 && N % 2 == 0, "pairs of 2-byte weights");
  using Pair = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
#pragma unroll
  for (int j = 0; j < N / 2; ++j) {
    const float2 x = g.get2(j);
    g.set2(j, __fmul_rn(x.x, inv), __fmul_rn(x.y, inv));
    Pair& pair = *reinterpret_cast<Pair*>(g.e + 2 * j);
    pair = __hmul2_rn(pair, *reinterpret_cast<const Pair*>(w.e + 2 * j));
  }
}

// Calls f(T{}, std::integral_constant<bool, fp8>{}) for the element type and
// the pool kind: the one dtype switch of both launchers.
template <typename F>
cudaError_t with_element_type(core::DType dtype, bool fp8, F&& f) {
  using Fp8 = std::true_type;
  using Same = std::false_type;
  switch (dtype) {
    case core::DType::Float16: return fp8 ? f(__half{}, Fp8{}) : f(__half{}, Same{});
    case core::DType::BFloat16: return fp8 ? f(__nv_bfloat16{}, Fp8{}) : f(__nv_bfloat16{}, Same{});
    case core::DType::Float32: return fp8 ? f(float{}, Fp8{}) : f(float{}, Same{});
    default: return cudaErrorInvalidValue;
  }
}

// The general QK-norm kernel (cuda/rope_norm_pool.cu), for parameters with
// norm_q or norm_k set that the rotation kernel does not take
// (core::rope_norm_in_rotation_kernel); same contract as rope_pool().
cudaError_t rope_norm_pool(const RopePoolParams& params, const RopePoolPointers& ptrs, core::DType dtype,
                           cudaStream_t stream);

}  // namespace attnprep::cuda::rope
