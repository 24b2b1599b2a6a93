// The Ulysses send side in one pass: a block per send row (s, b). The row's q, k and v groups (16 bytes each) are
// copied to shared memory at once (cp.async: no registers held in flight, each thread reads back its own copies),
// then q and k go through registers a round of the block's threads at a time, each thread a unit of one group or (GPT-J
// rows) two adjacent ones; the norm's pairwise sum runs over units, lanes, warps and rounds (per token) or a head's
// lanes (per head); a thread holds the same elements of a head in every round (its cos/sin read once per row); every
// group is written once (a replicated kv head once per destination); fp8 rows write each k unit with its v unit (two
// amaxes side by side).
#include "cuda/ulysses_send.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

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
// At most 256 threads a block; a per-token norm takes all 256 (its pairwise sum spans a power of two of units a
// round), other rows the fewest warps that keep the rounds they need (Flux's 192 units: 1 round of 192, not 256).
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Blocks per SM the registers must allow, by the unit's groups U: plain rows of one 5 (48 registers), any other 4 (64;
// fp8 with U 2 spills 12 bytes, and 3 blocks, spill-free, measured slower). A round's unit is read from shared memory
// where it is needed, none held across rounds.
template <int Wire, int U>
constexpr int kMinBlocks = U == 2      ? 4
                           : Wire == 0 ? 5
                                       : 4;
constexpr int kRounds = 4;  // a tensor's row of up to 4 * 256 units (bf16: 8192 values, Wan 2.1-14B's 5120)
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

// A thread's unit of a head: N elements, N * sizeof(T) a multiple of 16 bytes, moved 16 bytes at a time.
template <typename T, int N>
__device__ __forceinline__ void load16s(Group<T, N>& g, const T* at) {
#pragma unroll
  for (int j = 0; j < N * static_cast<int>(sizeof(T)) / 16; ++j)
    reinterpret_cast<uint4*>(g.e)[j] = __ldg(reinterpret_cast<const uint4*>(at) + j);
}
template <typename T, int N>
__device__ __forceinline__ void store16s(const Group<T, N>& g, T* at) {
#pragma unroll
  for (int j = 0; j < N * static_cast<int>(sizeof(T)) / 16; ++j)
    reinterpret_cast<uint4*>(at)[j] = reinterpret_cast<const uint4*>(g.e)[j];
}
template <typename T, int N>
__device__ __forceinline__ void read_stage(Group<T, N>& g, const uint4* stage, int unit) {
  constexpr int V = N * static_cast<int>(sizeof(T)) / 16;
#pragma unroll
  for (int j = 0; j < V; ++j) reinterpret_cast<uint4*>(g.e)[j] = stage[unit * V + j];
}

// Writes unit g[0] of head h (q when is_q, else a kv head at slot offset `kv_slot`: 0 for k, local_kv for v) and,
// with K 2, g[1] as the same kv head's v, to each destination that takes them: plain (Wire 0), or as fp8 wire bytes
// with each head's scale. Every lane of the warp calls it (an amax is a reduction over a head's lanes).
template <typename T, int G, int Wire, int K = 1>
__device__ __forceinline__ void put(const UlyssesSendParams& p, const Divisors& div, const Row& r, bool is_q, int h,
                                    int within, int kv_slot, const Group<T, G> (&g)[K], bool active) {
  int d0 = 0, count = 1, slot = 0;
  const int v_slot = p.kv_heads >= p.world ? p.local_kv : 1;  // g[1]'s offset from g[0]'s (k's) slot
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
#pragma unroll
      for (int j = 0; j < K; ++j)
        store16s(g[j], reinterpret_cast<T*>(r.base + d * r.stride) + (slot + j * v_slot) * p.head_dim + within);
  } else {
    constexpr auto F = static_cast<core::WireFormat>(Wire);
    const T* values[K];
#pragma unroll
    for (int j = 0; j < K; ++j) values[j] = g[j].e;
    float amax[K];
    fp8_wire::block_amax<T, G, K>(values, static_cast<unsigned>(p.head_dim / G), amax);
    if (!active) return;
    float scale[K], inv[K];
#pragma unroll
    for (int j = 0; j < K; ++j) fp8_wire::block_scale<F>(amax[j], scale[j], inv[j]);
    uint32_t words[K][G / 4];  // the G fp8 bytes of each, first element lowest
#pragma unroll
    for (int j = 0; j < K; ++j)
#pragma unroll
      for (int i = 0; i < G; i += 4) {
        const uint32_t lo = fp8_wire::to_fp8x2<F>(to_float(g[j].e[i]), to_float(g[j].e[i + 1]), inv[j]);
        const uint32_t hi = fp8_wire::to_fp8x2<F>(to_float(g[j].e[i + 2]), to_float(g[j].e[i + 3]), inv[j]);
        words[j][i / 4] = lo | (hi << 16);
      }
    for (int d = d0; d < d0 + count; ++d) {
      unsigned char* row = r.base + d * r.stride;
#pragma unroll
      for (int j = 0; j < K; ++j) {
        const int at = (slot + j * v_slot) * p.head_dim + within;
        if constexpr (G == 16)
          *reinterpret_cast<uint4*>(row + at) = make_uint4(words[j][0], words[j][1], words[j][2], words[j][3]);
        else if constexpr (G == 8)
          *reinterpret_cast<uint2*>(row + at) = make_uint2(words[j][0], words[j][1]);
        else
          *reinterpret_cast<uint32_t*>(row + at) = words[j][0];
        if (within == 0)
          *reinterpret_cast<float*>(row + int64_t{p.n} * p.head_dim + 4 * (slot + j * v_slot)) = scale[j];
      }
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

// Starts the copies of a tensor's row (`units` units of U 16-byte groups, heads `sh` elements apart, a 16-byte
// group's index shifted by g16_shift its head) to `stage`, each thread the units it works (it reads back only its own
// copies: no barrier), and commits them as one group (empty where there is nothing to copy: every thread commits).
template <typename T, int U>
__device__ __forceinline__ void stage_row(uint4* stage, const T* row, int64_t sh, int units, int g16_shift) {
  constexpr int G16 = 16 / static_cast<int>(sizeof(T));
  for (int ui = static_cast<int>(threadIdx.x); ui < units; ui += static_cast<int>(blockDim.x)) {
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int gi = ui * U + j, h = gi >> g16_shift;
      copy_async_streaming(stage + gi, row + h * sh + (gi - (h << g16_shift)) * G16);
    }
  }
  commit_async_copies();
}

// The factor of a norm over `n` elements whose pairwise sum is ss.
__device__ __forceinline__ float norm_inv(float ss, int n, float eps) {
  return rcp_sqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(n)), eps));
}

// q (or k) of the row: loaded, normalized, rotated, written; kWithV: each k unit written with its v unit (from
// v_stage where staged, else from v_row), their fp8 amaxes side by side.
template <typename T, int G, int Wire, int kCs, bool kWithV = false>
__device__ __forceinline__ void norm_rope_put(const UlyssesSendParams& p, const Divisors& div,
                                              const UlyssesSendPointers& ptr, const Row& r, bool is_q,
                                              const float2 (&cs)[kCs], const uint4* stage, float (*sums)[kWarps],
                                              const T* v_row = nullptr, const uint4* v_stage = nullptr) {
  constexpr bool kNeox = kCs == G;  // units of two groups only for GPT-J rows (their cos/sin take half the registers)
  const int heads = is_q ? p.heads : p.kv_heads;
  const int norm = is_q ? p.norm_q : p.norm_k;
  const void* weight = r.s < p.text_rows ? (is_q ? ptr.q_text_weight : ptr.k_text_weight)
                                         : (is_q ? ptr.q_norm_weight : ptr.k_norm_weight);
  const int uph = p.head_dim / G;  // units per head: a power of two up to 32
  const int uph_shift = __ffs(uph) - 1;
  const int units = heads * uph;
  const int threads = static_cast<int>(blockDim.x), rounds = (units + threads - 1) / threads;
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) / 32;
  // a round's unit, read from the staged row twice (the norm's sum, then the work): no registers held across rounds
  const auto staged = [&](int k) {
    Group<T, G> g;
    const int ui = k * threads + static_cast<int>(threadIdx.x);
    if (ui < units) {
      read_stage(g, stage, ui);
    } else {
#pragma unroll
      for (int i = 0; i < G; ++i) g.e[i] = from_float<T>(0.f);
    }
    return g;
  };
  // the thread's elements of a head are the same in every round (the block's threads are a multiple of uph)
  const int within = (static_cast<int>(threadIdx.x) & (uph - 1)) * G;
  float inv[kRounds];
#pragma unroll
  for (int k = 0; k < kRounds; ++k) inv[k] = 1.f;
  if (norm == core::kSendNormHead) {
    const float inv_head_dim = 1.f / static_cast<float>(p.head_dim);  // a power of two: s * it is s / head_dim exactly
#pragma unroll
    for (int k = 0; k < kRounds; ++k) {
      if (k >= rounds) break;
      float s = group_squares(staged(k));
      for (int off = 1; off < uph; off *= 2) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, off));
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
  const int partner = p.is_neox ? half / G : 0;  // NeoX: lanes apart of a pair's units (a power of two)
#pragma unroll
  for (int k = 0; k < kRounds; ++k) {
    if (k >= rounds) break;
    const int ui = k * threads + static_cast<int>(threadIdx.x);
    const bool active = ui < units;
    const int h = ui >> uph_shift;
    Group<T, G> g = staged(k);
    if (norm != core::kSendNoNorm && active) {
      const int at = norm == core::kSendNormHead ? within : h * p.head_dim + within;  // 16-byte aligned (the plan)
      bool paired = false;
      if constexpr (sizeof(T) == 2) {
        if (!p.weight_f32 && p.offset == 0.f) {  // 2-byte weights as loaded: one paired multiply a pair
          Group<T, G> w;
          load16s(w, static_cast<const T*>(weight) + at);
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
    if (kNeox && p.is_neox) {
      Group<T, G> other;  // the pair's other unit, `partner` lanes away (every lane takes part)
#pragma unroll
      for (int j = 0; j < G * static_cast<int>(sizeof(T)) / 4; ++j)
        reinterpret_cast<uint32_t*>(other.e)[j] =
            __shfl_xor_sync(0xffffffffu, reinterpret_cast<const uint32_t*>(g.e)[j], partner);
      if (active && within < p.rotary_dim) {
        const bool first = within < half;
#pragma unroll
        for (int i = 0; i < G; ++i) {
          const float2 c = cs[i % kCs];  // kCs is G where NeoX runs
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
    if constexpr (kWithV) {
      Group<T, G> kv[2] = {g, {}};
      if (active && v_stage)
        read_stage(kv[1], v_stage, ui);
      else if (active)
        load16s(kv[1], v_row + h * p.v_h + within);
      else
#pragma unroll
        for (int i = 0; i < G; ++i) kv[1].e[i] = from_float<T>(0.f);
      put<T, G, Wire, 2>(p, div, r, false, h, within, 0, kv, active);
    } else {
      const Group<T, G> one[1] = {g};
      put<T, G, Wire>(p, div, r, is_q, h, within, 0, one, active);
    }
  }
}

template <typename T, int Wire, int U>
__global__ void __launch_bounds__(kThreads, kMinBlocks<Wire, U>)
    ulysses_send_kernel(const UlyssesSendParams p, const UlyssesSendPointers ptr) {
  constexpr int G16 = 16 / sizeof(T), G = U * G16;  // a 16-byte group's elements; a thread's unit's (U groups)
  constexpr int kCs = U == 1 ? G : G / 2;
  __shared__ float sums[kRounds][kWarps];
  extern __shared__ uint4 stage[];  // the row's q groups, then k's, then v's (where they fit)
  const int64_t row = blockIdx.x;
  const int64_t unit = Wire == 0 ? int64_t{p.n} * p.head_dim * static_cast<int64_t>(sizeof(T)) : p.row_bytes;
  const Row r{row / p.B, row - (row / p.B) * p.B, static_cast<unsigned char*>(ptr.send) + row * unit, p.S * p.B * unit};
  const int g16ph = p.head_dim / G16, g16_shift = __ffs(g16ph) - 1;
  const int uph = p.head_dim / G, uph_shift = __ffs(uph) - 1, gq = p.heads * uph, gk = p.kv_heads * uph;
  const bool staged_v = stages_v(p, G16);
  const Divisors div{HeadDivisor(p.local_q), HeadDivisor(p.local_kv)};
  const T* v = static_cast<const T*>(ptr.v) + r.b * p.v_b + r.s * p.v_s;
  wait_for_prior_kernels();
  stage_row<T, U>(stage, static_cast<const T*>(ptr.q) + r.b * p.q_b + r.s * p.q_s, p.q_h, gq, g16_shift);
  stage_row<T, U>(stage + gq * U, static_cast<const T*>(ptr.k) + r.b * p.k_b + r.s * p.k_s, p.k_h, gk, g16_shift);
  stage_row<T, U>(stage + (gq + gk) * U, v, p.v_h, staged_v ? gk : 0, g16_shift);
  // the row's cos/sin
  int64_t table_row = p.rows_kind == core::kSendRowsShared ? r.s : r.b * p.S + r.s;
  if (p.rows_kind == core::kSendPositions)
    table_row = read_index(ptr.positions, r.b * p.pos_b + r.s * p.pos_s, p.positions_int64);
  const bool row_ok = table_row >= 0 && table_row < p.table_rows;
  const float* cs_row = ptr.cos_sin + (row_ok ? table_row : 0) * p.table_stride;
  // the thread's (cos, sin) for q and k in every round: NeoX G frequencies from its place in the half, GPT-J G / 2
  const int within = (static_cast<int>(threadIdx.x) & (uph - 1)) * G, half = p.rotary_dim / 2;
  float2 cs[kCs];
  if (within < p.rotary_dim) {
    if (U == 1 && p.is_neox)
      row_cos_sin<kCs>(cs_row + (within < half ? within : within - half), half, row_ok, cs);
    else
      row_cos_sin<G / 2>(cs_row + within / 2, half, row_ok, reinterpret_cast<float2(&)[G / 2]>(cs));
  }
  wait_async_copies_but<2>();  // q's copies
  norm_rope_put<T, G, Wire, kCs>(p, div, ptr, r, true, cs, stage, sums);
  if constexpr (Wire != 0) {  // k and v together (their fp8 amaxes side by side)
    wait_async_copies_but<0>();
    let_next_kernel_start();
    norm_rope_put<T, G, Wire, kCs, true>(p, div, ptr, r, false, cs, stage + gq * U, sums, v,
                                         staged_v ? stage + (gq + gk) * U : nullptr);
  } else {
    wait_async_copies_but<1>();  // k's
    norm_rope_put<T, G, Wire, kCs>(p, div, ptr, r, false, cs, stage + gq * U, sums);
    let_next_kernel_start();
    wait_async_copies_but<0>();  // v's
    const int units = gk;
    for (int base = 0; base < units; base += static_cast<int>(blockDim.x)) {
      const int ui = base + static_cast<int>(threadIdx.x);
      const bool active = ui < units;
      const int h = active ? ui >> uph_shift : 0, at = active ? (ui - h * uph) * G : 0;
      Group<T, G> g[1];
      if (active && staged_v)
        read_stage(g[0], stage + (gq + gk) * U, ui);
      else if (active)
        load16s(g[0], v + h * p.v_h + at);
      else
#pragma unroll
        for (int i = 0; i < G; ++i) g[0].e[i] = from_float<T>(0.f);
      put<T, G, Wire>(p, div, r, false, h, at, p.kv_heads >= p.world ? p.local_kv : 1, g, active);
    }
  }
  if (Wire != 0) {  // each destination row's zero padding after its scales
    const int64_t used = int64_t{p.n} * p.head_dim + 4 * p.n;
    for (int d = static_cast<int>(threadIdx.x); d < p.world; d += static_cast<int>(blockDim.x)) {
      unsigned char* row = r.base + d * r.stride;
      for (int64_t at = used; at < p.row_bytes; at += 4) *reinterpret_cast<uint32_t*>(row + at) = 0u;
    }
  }
}

// The block's threads (above): 256 for a per-token norm, else the rounds' units (G elements) spread over the fewest
// warps.
int block_threads(const core::UlyssesSendParams& p, int G) {
  if (p.norm_q == core::kSendNormToken || p.norm_k == core::kSendNormToken) return kThreads;
  const int units = std::max(p.heads, p.kv_heads) * (p.head_dim / G);
  const int rounds = std::max(1, (units + kThreads - 1) / kThreads);
  return ((units + rounds - 1) / rounds + 31) / 32 * 32;
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
    constexpr int G16 = 16 / static_cast<int>(sizeof(T));
    const size_t bytes = stage_bytes(p, G16);
    // units of two groups: GPT-J rows whose heads and rotated part span whole units
    const bool two = !p.is_neox && p.head_dim % (2 * G16) == 0 && p.rotary_dim % (2 * G16) == 0;
    const dim3 block(block_threads(p, two ? 2 * G16 : G16));
    const auto go = [&](auto wire) {
      constexpr int W = decltype(wire)::value;
      return two ? launch_kernel_shared(ulysses_send_kernel<T, W, 2>, grid, block, bytes, stream, p, ptr)
                 : launch_kernel_shared(ulysses_send_kernel<T, W, 1>, grid, block, bytes, stream, p, ptr);
    };
    if (p.wire == static_cast<int32_t>(core::WireFormat::E4M3FN)) return go(std::integral_constant<int, 1>{});
    if (p.wire == static_cast<int32_t>(core::WireFormat::E5M2)) return go(std::integral_constant<int, 2>{});
    return go(std::integral_constant<int, 0>{});
  });
}

}  // namespace attnprep::cuda
