// The QK norm of the RoPE kernels (docs/contract.md): the weights' staging,
// the pairwise sum of squares, the factor and the normalization, shared by
// the rotation kernel and the general QK-norm kernel.
#pragma once

#include <cstdint>

#include "core/rope_pool_params.h"
#include "cuda/rcp_sqrt.cuh"
#include "cuda/rope_group.cuh"

namespace attnprep::cuda::rope {

// Where the norm weights sit in shared memory: q's at 0, k's at this offset.
constexpr int kNormWeightsK = 2 * ATTNPREP_ROPE_MAX_HALF;

// How a normalized value meets its weight (docs/contract.md): Llama/Qwen3
// (norm_weight_offset 0) round x inv to T first, then T(that * w); Gemma
// (any other offset) T((x inv) * (offset + w)), offset + w rounded once.
enum NormMode : int { kNoNorm = 0, kNormRoundThenWeight = 1, kNormOffsetWeight = 2 };

__host__ __device__ __forceinline__ NormMode norm_mode(const RopePoolParams& p) {
  return p.norm_offset == 0.f ? kNormRoundThenWeight : kNormOffsetWeight;
}

// The block's norm weights as float32 in shared memory (q's at w[i], k's at w[kNormWeightsK + i]), asked for before
// the cos/sin table and stored after it, so their round trip overlaps the table's work; the caller's barrier
// publishes them.
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
  if (raw_q)
    reinterpret_cast<unsigned short*>(w)[i] = static_cast<unsigned short>(b.q);
  else
    w[i] = staged_weight<T>(b.q, p.norm_q, p.q_norm_f32, p.norm_offset);
  if (raw_k)
    reinterpret_cast<unsigned short*>(w + kNormWeightsK)[i] = static_cast<unsigned short>(b.k);
  else
    w[kNormWeightsK + i] = staged_weight<T>(b.k, p.norm_k, p.k_norm_f32, p.norm_offset);
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

// A thread's run of kG groups (absent ones count as zeros) summed pairwise: each group's subtree, then adjacent
// groups' sums, and so on: the contract's order over the run.
template <typename T, int N, int kG>
__device__ __forceinline__ float run_squares(const Group<T, N> (&x)[kG], const bool (&has)[kG]) {
  float part[kG];
#pragma unroll
  for (int j = 0; j < kG; ++j) part[j] = has[j] ? group_squares(x[j]) : 0.f;
#pragma unroll
  for (int step = 1; step < kG; step *= 2)
#pragma unroll
    for (int j = 0; j < kG; j += 2 * step) part[j] = __fadd_rn(part[j], part[j + step]);
  return part[0];
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
__device__ __forceinline__ float inv_pow2(int head_dim) { return __int_as_float((127 - (31 - __clz(head_dim))) << 23); }

// x inv rounded to T and back (kNormRoundThenWeight), for a pair.
template <typename T>
__device__ __forceinline__ float2 round_through(float a, float b) {
  T pair[2];
  from_float2(pair, a, b);
  return to_float2(pair);
}

// A group normalized in place, weight(i) its element i's float32 weight; the NormMode is a template parameter
// because a run-time select per element issued both ways.
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

// The same with the weights staged in shared memory at `w` (16-byte aligned when N is a multiple of 4, so they load
// four at a time).
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

// Weights off ... off + N - 1 of a weight tensor (float32, or T's) as float32, 16 bytes at a time (alignment checked
// by the launcher).
template <typename T, int N>
__device__ __forceinline__ void weights16(const void* w, bool f32, int off, float (&wv)[N]) {
  if (sizeof(T) == 4 || f32) {
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
}

// The weights of elements off ... off + N - 1 of a q (or k) head straight from the weight tensor: each warp reads
// its own from L1, with no block-wide staging or barrier.
template <int kMode, typename T, int N>
__device__ __forceinline__ void row_norm_weights(const RopePoolParams& p, const RopePoolPointers& ptr, bool is_k,
                                                 int off, float (&wv)[N]) {
  weights16<T>(is_k ? ptr.k_norm_weight : ptr.q_norm_weight, is_k ? p.k_norm_f32 : p.q_norm_f32, off, wv);
  if constexpr (kMode == kNormOffsetWeight) {
#pragma unroll
    for (int i = 0; i < N; ++i) wv[i] = __fadd_rn(p.norm_offset, wv[i]);
  }
}

// kNormRoundThenWeight with 2-byte weights: T(float32(T(x inv)) * w) is a product of two T values rounded once (their
// float32 product is exact or rounds to zero either way), so one paired T multiply computes it on the weights as
// loaded.
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

}  // namespace attnprep::cuda::rope
