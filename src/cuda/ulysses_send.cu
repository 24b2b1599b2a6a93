// The Ulysses send side in one pass: a block per send row (s, b). The row's q, k and v groups (16 bytes each) are
// copied to shared memory at once (cp.async: no registers held in flight, each thread reads back its own copies),
// then q and k go through registers a round of the block's threads at a time; the norm's pairwise sum runs over groups,
// lanes, warps and rounds (per token) or a head's lanes (per head); a thread holds the same elements of a head in every
// round (its cos/sin read once per row); every group is written once (a replicated kv head once per destination).
#include "cuda/ulysses_send.h"

#include <algorithm>
#include <cstdint>

#include "cuda/block_sum.cuh"
#include "cuda/fp8_wire.cuh"
#include "cuda/launch.h"
#include "cuda/rcp_sqrt.cuh"
#include "cuda/rope_cos_sin.cuh"
#include "cuda/rope_group.cuh"
#include "cuda/rope_norm.cuh"

namespace attnprep::cuda {
namespace {

using core::UlyssesSendParams;
using namespace rope;
// At most 256 threads a block; a per-token norm takes all 256 (its pairwise sum spans a power of two of groups a
// round), other rows the fewest warps that keep the rounds they need (Flux's 384 groups: 2 rounds of 192, not 256).
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Blocks per SM the registers must allow: plain rows 5 (48 registers), fp8 rows 4 (64; at 5 they spill). A round's
// group is read from shared memory where it is needed, none held across rounds.
template <int Wire>
constexpr int kMinBlocks = Wire == 0 ? 5 : 4;
constexpr int kRounds = 4;  // a tensor's row of up to 4 * 256 groups (bf16: 8192 values, Wan 2.1-14B's 5120)
// Shared memory for the row's staged groups without an opt-in (48 KB, less the norm's sums): q's and k's always; v's
// where they fit too (else v is read straight into registers).
constexpr int kStageBytes = 48 * 1024 - kRounds * kWarps * 4;
__host__ __device__ __forceinline__ bool stages_v(const UlyssesSendParams& p, int G) {
  return (p.heads + 2 * p.kv_heads) * (p.head_dim / G) * 16 <= kStageBytes;
}
__host__ __device__ __forceinline__ int stage_bytes(const UlyssesSendParams& p, int G) {
  return (p.heads + (stages_v(p, G) ? 2 : 1) * p.kv_heads) * (p.head_dim / G) * 16;
}

struct Row {  // the send row (s, b)
  int64_t s, b;
  unsigned char* base;  // the row's start in destination 0's part of the send buffer
  int64_t stride;       // bytes between destinations' parts
};

// The send row of destination d for row (s, b): its index among the buffer's world * S * B rows.
__device__ __forceinline__ int64_t send_row(const UlyssesSendParams& p, const Row& r, int d) {
  return (d * p.S + r.s) * p.B + r.b;
}

// h / n for a row's heads by a multiply-high with ceil(2^32 / n): exact for h, n < 2^16 (the plan allows 1024
// groups of q or k a row); the kernel makes one per divisor at its start, in place of an integer division per group.
struct HeadDivisor {
  unsigned n, magic;
  __device__ explicit HeadDivisor(int n_) : n(static_cast<unsigned>(n_)), magic(n > 1 ? 0xffffffffu / n + 1 : 0) {}
  __device__ __forceinline__ int operator()(int h) const {
    return n > 1 ? static_cast<int>(__umulhi(static_cast<unsigned>(h), magic)) : h;
  }
};
struct Divisors {
  HeadDivisor q, kv;
};

// Writes group g of head h (q when is_q, else a kv head at slot offset `kv_slot`: 0 for k, local_kv for v) to each
// destination that takes it: plain (Wire 0), or as fp8 wire bytes with the head's scale. Every lane of the warp
// calls it (the head's largest magnitude is a reduction over its gph lanes); `active` lanes hold a group.
template <typename T, int G, int Wire>
__device__ __forceinline__ void put(const UlyssesSendParams& p, const Divisors& div, const Row& r, bool is_q, int h,
                                    int within, int kv_slot, const Group<T, G>& g, bool active) {
  int d0 = 0, count = 1, slot = 0;
  if (is_q) {
    d0 = div.q(h), slot = h - d0 * p.local_q;
  } else if (p.kv_heads >= p.world) {
    d0 = div.kv(h), slot = p.local_q + kv_slot + h - d0 * p.local_kv;
  } else {  // kv head h goes to every destination of its replicas
    count = p.world / p.kv_heads, d0 = h * count, slot = p.local_q + kv_slot;
  }
  if constexpr (Wire == 0) {
    if (!active) return;
    for (int d = d0; d < d0 + count; ++d)
      g.store(reinterpret_cast<T*>(r.base + d * r.stride) + slot * p.head_dim + within);
  } else {
    constexpr auto F = static_cast<core::WireFormat>(Wire);
    float f[G];
#pragma unroll
    for (int i = 0; i < G; ++i) f[i] = to_float(g.e[i]);
    const float amax = fp8_wire::block_amax<T, G>(g.e, static_cast<unsigned>(p.head_dim / G));
    if (!active) return;
    float scale, inv;
    fp8_wire::block_scale<F>(amax, scale, inv);
    uint32_t words[G / 4];  // the G fp8 bytes, first element lowest
#pragma unroll
    for (int i = 0; i < G; i += 4) {
      const uint32_t lo = fp8_wire::to_fp8x2<F>(f[i], f[i + 1], inv);
      const uint32_t hi = fp8_wire::to_fp8x2<F>(f[i + 2], f[i + 3], inv);
      words[i / 4] = lo | (hi << 16);
    }
    for (int d = d0; d < d0 + count; ++d) {
      unsigned char* row = r.base + d * r.stride;
      if constexpr (G == 8)
        *reinterpret_cast<uint2*>(row + slot * p.head_dim + within) = make_uint2(words[0], words[1]);
      else
        *reinterpret_cast<uint32_t*>(row + slot * p.head_dim + within) = words[0];
      if (within == 0) *reinterpret_cast<float*>(row + int64_t{p.n} * p.head_dim + 4 * slot) = scale;
    }
  }
}

// N (cos, sin) pairs of a row's frequencies f ... f + N - 1 (cosines at `at`, sines `half` further; 16-byte loads
// where N allows, alignment checked by the plan), NaN for a position outside the table.
template <int N>
__device__ __forceinline__ void row_cos_sin(const float* at, int half, bool row_ok, float2 (&cs)[N]) {
  if (row_ok) {
    float32_cos_sin<N, true>(at, at + half, cs);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) cs[i] = make_float2(NAN, NAN);
  }
}

// Starts the copies of a tensor's row (`groups` 16-byte groups, heads `sh` elements apart) to `stage`, and commits
// them as one group (empty where there is nothing to copy, so every thread commits the same count).
template <typename T, int G>
__device__ __forceinline__ void stage_row(uint4* stage, const T* row, int64_t sh, int groups, int gph_shift) {
  for (int gi = static_cast<int>(threadIdx.x); gi < groups; gi += static_cast<int>(blockDim.x)) {
    const int h = gi >> gph_shift;
    copy_async_streaming(stage + gi, row + h * sh + (gi - (h << gph_shift)) * G);
  }
  commit_async_copies();
}

// The factor of a norm over `n` elements whose pairwise sum is ss.
__device__ __forceinline__ float norm_inv(float ss, int n, float eps) {
  return rcp_sqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(n)), eps));
}

// q (or k) of the row: loaded, normalized, rotated, written.
template <typename T, int G, int Wire>
__device__ __forceinline__ void norm_rope_put(const UlyssesSendParams& p, const Divisors& div,
                                              const UlyssesSendPointers& ptr, const Row& r, bool is_q,
                                              const float2 (&cs)[G], const uint4* stage, float (*sums)[kWarps]) {
  const int heads = is_q ? p.heads : p.kv_heads;
  const int norm = is_q ? p.norm_q : p.norm_k;
  const void* weight = r.s < p.text_rows ? (is_q ? ptr.q_text_weight : ptr.k_text_weight)
                                         : (is_q ? ptr.q_norm_weight : ptr.k_norm_weight);
  const int gph = p.head_dim / G;  // groups per head: a power of two up to 32
  const int gph_shift = __ffs(gph) - 1;
  const int groups = heads * gph;
  const int threads = static_cast<int>(blockDim.x), rounds = (groups + threads - 1) / threads;
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) / 32;
  // a round's group, read from the staged row twice (the norm's sum, then the work): no registers held across rounds
  const auto staged = [&](int k) {
    Group<T, G> g;
    const int gi = k * threads + static_cast<int>(threadIdx.x);
    if (gi < groups) {
      *reinterpret_cast<uint4*>(g.e) = stage[gi];
    } else {
#pragma unroll
      for (int i = 0; i < G; ++i) g.e[i] = from_float<T>(0.f);
    }
    return g;
  };
  // the thread's elements of a head are the same in every round (the block's threads are a multiple of gph)
  const int within = (static_cast<int>(threadIdx.x) & (gph - 1)) * G;
  float inv[kRounds];
#pragma unroll
  for (int k = 0; k < kRounds; ++k) inv[k] = 1.f;
  if (norm == core::kSendNormHead) {
    const float inv_head_dim = 1.f / static_cast<float>(p.head_dim);  // a power of two: s * it is s / head_dim exactly
#pragma unroll
    for (int k = 0; k < kRounds; ++k) {
      if (k >= rounds) break;
      float s = group_squares(staged(k));
      for (int off = 1; off < gph; off *= 2) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, off));
      inv[k] = rcp_sqrt_rn(__fadd_rn(__fmul_rn(s, inv_head_dim), p.eps));
    }
  } else if (norm == core::kSendNormToken) {
    const int padded_rounds = max(1, (is_q ? p.padded_q : p.padded_k) / (kThreads * G));
#pragma unroll
    for (int k = 0; k < kRounds; ++k) {
      if (k >= rounds) break;
      float s = group_squares(staged(k));
      for (int off = 1; off < 32; off *= 2) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, off));
      if (lane == 0) sums[k][warp] = s;
    }
    __syncthreads();
    const float total = block_pairwise_total<kRounds, kWarps>(sums, min(rounds, padded_rounds));
    const float all = norm_inv(total, heads * p.head_dim, p.eps);
#pragma unroll
    for (int k = 0; k < kRounds; ++k) inv[k] = all;
    __syncthreads();  // sums is reused by the next tensor
  }
  const int half = p.rotary_dim / 2;
  const int partner = p.is_neox ? half / G : 0;  // NeoX: lanes apart of a pair's groups (a power of two)
#pragma unroll
  for (int k = 0; k < kRounds; ++k) {
    if (k >= rounds) break;
    const int gi = k * threads + static_cast<int>(threadIdx.x);
    const bool active = gi < groups;
    const int h = gi >> gph_shift;
    Group<T, G> g = staged(k);
    if (norm != core::kSendNoNorm && active) {
      const int at = norm == core::kSendNormHead ? within : h * p.head_dim + within;  // 16-byte aligned (the plan)
      bool paired = false;
      if constexpr (sizeof(T) == 2) {
        if (!p.weight_f32 && p.offset == 0.f) {  // 2-byte weights as loaded: one paired multiply a pair
          Group<T, G> w;
          w.load(static_cast<const T*>(weight) + at);
          normalize_round_then_t_weight(g, w, inv[k]);
          paired = true;
        }
      }
      if (!paired) {
        float w[G];
        weights16<T>(weight, p.weight_f32, at, w);
        if (p.offset == 0.f) {
          normalize_with<kNormRoundThenWeight>(g, [&](int i) { return w[i]; }, inv[k]);
        } else {
#pragma unroll
          for (int i = 0; i < G; ++i) w[i] = __fadd_rn(p.offset, w[i]);
          normalize_with<kNormOffsetWeight>(g, [&](int i) { return w[i]; }, inv[k]);
        }
      }
    }
    if (p.is_neox) {
      Group<T, G> other;  // the pair's other group, `partner` lanes away (every lane takes part)
      const uint4 mine = *reinterpret_cast<const uint4*>(g.e);
      uint4 theirs;
      theirs.x = __shfl_xor_sync(0xffffffffu, mine.x, partner);
      theirs.y = __shfl_xor_sync(0xffffffffu, mine.y, partner);
      theirs.z = __shfl_xor_sync(0xffffffffu, mine.z, partner);
      theirs.w = __shfl_xor_sync(0xffffffffu, mine.w, partner);
      *reinterpret_cast<uint4*>(other.e) = theirs;
      if (active && within < p.rotary_dim) {
        const bool first = within < half;
#pragma unroll
        for (int i = 0; i < G; ++i) {
          const float2 c = cs[i];
          const float a = to_float(first ? g.e[i] : other.e[i]), b = to_float(first ? other.e[i] : g.e[i]);
          g.e[i] = from_float<T>(first ? rotate_first(a, b, c) : rotate_second(a, b, c));
        }
      }
    } else if (active && within < p.rotary_dim) {
#pragma unroll
      for (int j = 0; j < G / 2; ++j) {
        const float2 v = g.get2(j);
        g.set2(j, rotate_first(v.x, v.y, cs[j]), rotate_second(v.x, v.y, cs[j]));
      }
    }
    put<T, G, Wire>(p, div, r, is_q, h, within, 0, g, active);
  }
}

template <typename T, int Wire>
__global__ void __launch_bounds__(kThreads, kMinBlocks<Wire>)
    ulysses_send_kernel(const UlyssesSendParams p, const UlyssesSendPointers ptr) {
  constexpr int G = 16 / sizeof(T);
  __shared__ float sums[kRounds][kWarps];
  extern __shared__ uint4 stage[];  // the row's q groups, then k's, then v's (where they fit)
  const int64_t row = blockIdx.x;
  const int64_t unit = Wire == 0 ? int64_t{p.n} * p.head_dim * static_cast<int64_t>(sizeof(T)) : p.row_bytes;
  const Row r{row / p.B, row - (row / p.B) * p.B, static_cast<unsigned char*>(ptr.send) + row * unit, p.S * p.B * unit};
  const int gph = p.head_dim / G, gph_shift = __ffs(gph) - 1, gq = p.heads * gph, gk = p.kv_heads * gph;
  const bool staged_v = stages_v(p, G);
  const Divisors div{HeadDivisor(p.local_q), HeadDivisor(p.local_kv)};
  const T* v = static_cast<const T*>(ptr.v) + r.b * p.v_b + r.s * p.v_s;
  wait_for_prior_kernels();
  stage_row<T, G>(stage, static_cast<const T*>(ptr.q) + r.b * p.q_b + r.s * p.q_s, p.q_h, gq, gph_shift);
  stage_row<T, G>(stage + gq, static_cast<const T*>(ptr.k) + r.b * p.k_b + r.s * p.k_s, p.k_h, gk, gph_shift);
  stage_row<T, G>(stage + gq + gk, v, p.v_h, staged_v ? gk : 0, gph_shift);
  // the row's cos/sin
  int64_t table_row = p.rows_kind == core::kSendRowsShared ? r.s : r.b * p.S + r.s;
  if (p.rows_kind == core::kSendPositions)
    table_row = read_index(ptr.positions, r.b * p.pos_b + r.s * p.pos_s, p.positions_int64);
  const bool row_ok = table_row >= 0 && table_row < p.table_rows;
  const float* cs_row = ptr.cos_sin + (row_ok ? table_row : 0) * p.table_stride;
  // the thread's (cos, sin) for q and k in every round: NeoX G frequencies from its place in the half, GPT-J G / 2
  const int within = (static_cast<int>(threadIdx.x) & (gph - 1)) * G, half = p.rotary_dim / 2;
  float2 cs[G];
  if (within < p.rotary_dim) {
    if (p.is_neox)
      row_cos_sin<G>(cs_row + (within < half ? within : within - half), half, row_ok, cs);
    else
      row_cos_sin<G / 2>(cs_row + within / 2, half, row_ok, reinterpret_cast<float2(&)[G / 2]>(cs));
  }
  wait_async_copies_but<2>();  // q's copies
  norm_rope_put<T, G, Wire>(p, div, ptr, r, true, cs, stage, sums);
  wait_async_copies_but<1>();  // k's
  norm_rope_put<T, G, Wire>(p, div, ptr, r, false, cs, stage + gq, sums);
  let_next_kernel_start();
  wait_async_copies_but<0>();  // v's
  const int groups = gk;
  for (int base = 0; base < groups;
       base += static_cast<int>(blockDim.x)) {  // every lane of a warp in every round (put's reductions)
    const int gi = base + static_cast<int>(threadIdx.x);
    const bool active = gi < groups;
    const int h = active ? gi >> gph_shift : 0, at = active ? (gi - h * gph) * G : 0;
    Group<T, G> g;
    if (active && staged_v)
      *reinterpret_cast<uint4*>(g.e) = stage[gq + gk + gi];
    else if (active)
      g.load(v + h * p.v_h + at);
    else
#pragma unroll
      for (int i = 0; i < G; ++i) g.e[i] = from_float<T>(0.f);
    put<T, G, Wire>(p, div, r, false, h, at, p.kv_heads >= p.world ? p.local_kv : 1, g, active);
  }
  if (Wire != 0) {  // each destination row's zero padding after its scales
    const int64_t used = int64_t{p.n} * p.head_dim + 4 * p.n;
    for (int d = static_cast<int>(threadIdx.x); d < p.world; d += static_cast<int>(blockDim.x)) {
      unsigned char* row = static_cast<unsigned char*>(ptr.send) + send_row(p, r, d) * p.row_bytes;
      for (int64_t at = used; at < p.row_bytes; at += 4) *reinterpret_cast<uint32_t*>(row + at) = 0u;
    }
  }
}

// The block's threads (above): 256 for a per-token norm, else the rounds' groups spread over the fewest warps.
int block_threads(const core::UlyssesSendParams& p, int G) {
  if (p.norm_q == core::kSendNormToken || p.norm_k == core::kSendNormToken) return kThreads;
  const int groups = std::max(p.heads, p.kv_heads) * (p.head_dim / G);
  const int rounds = std::max(1, (groups + kThreads - 1) / kThreads);
  return ((groups + rounds - 1) / rounds + 31) / 32 * 32;
}

}  // namespace

cudaError_t ulysses_send(const core::UlyssesSendParams& p, const UlyssesSendPointers& ptr, core::DType dtype,
                         cudaStream_t stream) {
  const int64_t rows = p.S * p.B;
  if (rows == 0) return cudaSuccess;
  if (rows >= (int64_t{1} << 31)) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(rows));
  return with_element_type(dtype, false, [&](auto element, auto) {
    using T = decltype(element);
    const size_t bytes = stage_bytes(p, 16 / static_cast<int>(sizeof(T)));
    const dim3 block(block_threads(p, 16 / static_cast<int>(sizeof(T))));
    if (p.wire == static_cast<int32_t>(core::WireFormat::E4M3FN))
      return launch_kernel_shared(ulysses_send_kernel<T, 1>, grid, block, bytes, stream, p, ptr);
    if (p.wire == static_cast<int32_t>(core::WireFormat::E5M2))
      return launch_kernel_shared(ulysses_send_kernel<T, 2>, grid, block, bytes, stream, p, ptr);
    return launch_kernel_shared(ulysses_send_kernel<T, 0>, grid, block, bytes, stream, p, ptr);
  });
}

}  // namespace attnprep::cuda
