// Per-head QK RMSNorm + RoPE + pool write for the shapes the rotation kernel does not normalize itself (head_dim not
// a power of two, partial rotary, single-element access, long GPT-J heads): each head on `norm_lanes` lanes of one
// warp, the pairwise sum in the lane then a butterfly, NeoX partners exchanged through shared memory.
#include "core/rope_pool.h"
#include "cuda/launch.h"
#include "cuda/rope_cos_sin.cuh"
#include "cuda/rope_group.cuh"
#include "cuda/rope_norm.cuh"
#include "cuda/rope_token.cuh"

#include <cstdint>

namespace attnprep::cuda::rope {
namespace {

using Policy = core::RopeCudaPolicy;
constexpr int kThreads = Policy::max_threads;
constexpr int kMaxPerLane = Policy::norm_max_per_lane;

// Where one task (a head of q, k or v of token t) reads and writes.
template <typename T>
struct Task {
  const T* src = nullptr;
  T* dst = nullptr;     // q_rot/k_rot row; null for v
  bool normed = false;  // the head is normalized (weights: is_k ? k's : q's)
  bool is_k = false, is_v = false, to_pool = false;
  int head = 0;  // within q, k or v

  __device__ __forceinline__ Task(const RopePoolParams& p, const RopePoolPointers& ptr, int64_t t, int task) {
    const int hq = p.num_qo_heads, hkv = p.num_kv_heads;
    if (task < hq) {
      head = task;
      src = static_cast<const T*>(ptr.q) + t * p.q_stride_token + head * p.q_stride_head;
      dst = static_cast<T*>(ptr.q_rot) + t * p.qo_stride_token + head * p.qo_stride_head;
      normed = p.norm_q;
    } else if (task < hq + hkv) {
      head = task - hq;
      src = static_cast<const T*>(ptr.k) + t * p.k_stride_token + head * p.k_stride_head;
      dst = static_cast<T*>(ptr.k_rot) + t * p.ko_stride_token + head * p.ko_stride_head;
      normed = p.norm_k;
      is_k = true;
      to_pool = true;
    } else {
      head = task - hq - hkv;
      src = static_cast<const T*>(ptr.v) + t * p.v_stride_token + head * p.v_stride_head;
      is_v = true;
      to_pool = true;
    }
  }

  __device__ __forceinline__ bool is_q() const { return !is_k && !is_v; }

  // Asks L2 for the lane's part of the head's row now; the round that takes
  // this task later then loads from L2.
  __device__ __forceinline__ void prefetch(int first, int per_lane, int head_dim) const {
    for (int e = 0; e < per_lane && first + e < head_dim; e += 16 / static_cast<int>(sizeof(T)))
      prefetch_l2<false>(src + first + e);
  }
};

// Spills (sm_90): the one-element instantiations with fp8 outputs and float32's, 16-24 bytes at
// general_norm_min_blocks_per_sm (rare shapes: rows off 16 bytes with the QK norm).
template <typename T, int W, bool kFp8>
__global__ void __launch_bounds__(kThreads, Policy::general_norm_min_blocks_per_sm)
    rope_norm_pool_kernel(const __grid_constant__ RopePoolParams p, const RopePoolPointers ptr,
                          const core::RopeCudaIndex ix) {
  constexpr int kGroups = kMaxPerLane / W;  // vector groups a lane can hold
  __shared__ float2 cs[ATTNPREP_ROPE_MAX_HALF];
  // each lane's normalized elements, where its head's other lanes find their partners
  __shared__ __align__(16) T rows[kThreads * kMaxPerLane];
  __shared__ __align__(16) float norm_w[2 * kNormWeightsK];  // q's weights, then k's
  const int64_t t = blockIdx.x;
  const int half = p.rotary_dim / 2;
  const int D = p.head_dim, G = p.norm_lanes, R = p.norm_per_lane;
  const int n_tasks = core::rope_norm_heads_per_token(p);
  const int per_block = (n_tasks + static_cast<int>(gridDim.y) - 1) / static_cast<int>(gridDim.y);
  const int begin = static_cast<int>(blockIdx.y) * per_block;
  const int end = min(n_tasks, begin + per_block);
  const int per_round = static_cast<int>(blockDim.x) / G;
  const bool round_first = norm_mode(p) == kNormRoundThenWeight;
  // every lane walks the same rounds: the butterfly and the warp's shared
  // rows need all 32 lanes, busy or not
  const int rounds = end > begin ? (end - begin + per_round - 1) / per_round : 0;
  const int lane = static_cast<int>(threadIdx.x) & (G - 1);
  const int first = lane * R;  // the lane's first element of its head
  T* mine = rows + threadIdx.x * R;
  const T* head_row = rows + (threadIdx.x - lane) * R;

  wait_for_prior_kernels();  // cuda/launch.h: before any global memory access
  let_next_kernel_start();
  const TokenPlace place = token_place(p, ptr, t);
  const int64_t slot = place.slot;
  const bool write_pool = place.write_pool;
  const NormWeightBits first_w = start_norm_weights<T>(p, ptr);  // staged around the table
  for (int i = threadIdx.x; i < half; i += blockDim.x)
    cs[i] = token_cos_sin(p, ptr.cos_sin_cache, freq_position(p, ptr, t, place.pos, i), place.pos_ok, i, p.inv_freq[i]);
  finish_norm_weights<T>(norm_w, p, ptr, first_w);
  __syncthreads();

  for (int r = 0; r < rounds; ++r) {
    const int task = begin + r * per_round + static_cast<int>(threadIdx.x) / G;
    const bool active = task < end;
    const Task<T> h(p, ptr, t, active ? task : 0);
    const int next = task + per_round;  // this lane's task in the next round
    if (r + 1 < rounds && next < end) Task<T>(p, ptr, t, next).prefetch(first, R, D);
    Group<T, W> x[kGroups];
    // group j holds elements first + j W ...; head_dim is a multiple of W
    bool has[kGroups];
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      has[j] = active && j * W < R && first + j * W < D;
      if (has[j]) x[j].load(h.src + first + j * W);
    }

    // Sum of squares: each group's pairwise, then the lane's groups pairwise
    // (absent ones are zeros, which add nothing), then across the head's
    // lanes, nearest first: the contract's tree over the padded head.
    float ss = run_squares(x, has);
    for (int off = 1; off < G; off *= 2) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, off));

    if (h.normed) {
      const float inv = norm_factor(ss, p);
      const float* w = norm_w + (h.is_k ? kNormWeightsK : 0) + first;
#pragma unroll
      for (int j = 0; j < kGroups; ++j)
        if (has[j]) {
          if (round_first)
            normalize_group<kNormRoundThenWeight>(x[j], w + j * W, inv);
          else
            normalize_group<kNormOffsetWeight>(x[j], w + j * W, inv);
        }
    }

    // The rotation. NeoX partners come from the head's row in shared memory.
    __syncwarp();  // the previous round's readers are done with the rows
#pragma unroll
    for (int j = 0; j < kGroups; ++j)
      if (has[j]) x[j].store(mine + j * W);
    __syncwarp();
    if (!h.is_v) {
#pragma unroll
      for (int j = 0; j < kGroups; ++j) {
        if (!has[j]) continue;
        if (p.is_neox) {
#pragma unroll
          for (int i = 0; i < W; ++i) {
            const int d = first + j * W + i;
            if (d >= p.rotary_dim) continue;
            const float own = to_float(x[j].e[i]);
            x[j].e[i] = d < half ? from_float<T>(rotate_first(own, to_float(head_row[d + half]), cs[d]))
                                 : from_float<T>(rotate_second(to_float(head_row[d - half]), own, cs[d - half]));
          }
        } else if constexpr (W == 1) {  // GPT-J, one element per group: pairs are groups (2m, 2m + 1)
          const int d = first + j;
          if (j % 2 == 0 && j + 1 < kGroups && d < p.rotary_dim) {
            const float a = to_float(x[j].e[0]), b = to_float(x[j + 1].e[0]);
            x[j].e[0] = from_float<T>(rotate_first(a, b, cs[d / 2]));
            x[j + 1].e[0] = from_float<T>(rotate_second(a, b, cs[d / 2]));
          }
        } else {  // GPT-J: whole pairs in each group
#pragma unroll
          for (int i = 0; i < W; i += 2) {
            const int d = first + j * W + i;
            if (d >= p.rotary_dim) continue;
            const float a = to_float(x[j].e[i]), b = to_float(x[j].e[i + 1]);
            x[j].e[i] = from_float<T>(rotate_first(a, b, cs[d / 2]));
            x[j].e[i + 1] = from_float<T>(rotate_second(a, b, cs[d / 2]));
          }
        }
      }
    }

    if (!active) continue;
    if (h.dst) {
      if (kFp8 && p.q_fp8 && h.is_q()) {
        unsigned char* out = fp8_q_row(ptr, h.dst) + first;
        const core::Fp8Quotient quotient(*ptr.q_scale);
#pragma unroll
        for (int j = 0; j < kGroups; ++j)
          if (has[j]) store_fp8(x[j], out + j * W, quotient, 1);
      } else {
#pragma unroll
        for (int j = 0; j < kGroups; ++j)
          if (has[j]) x[j].store(h.dst + first + j * W);
      }
    }
    if (h.to_pool && write_pool) {
      const int64_t row = pool_row(p, ix.page, slot, h.head, h.is_v) + first;
      if (!kFp8 || !p.pool_fp8) {
        T* pool = static_cast<T*>(h.is_v ? ptr.v_pool : ptr.k_pool) + row;
#pragma unroll
        for (int j = 0; j < kGroups; ++j)
          if (has[j]) x[j].store(pool + j * W);
      } else {
        unsigned char* pool = static_cast<unsigned char*>(h.is_v ? ptr.v_pool : ptr.k_pool) + row;
        const core::Fp8Quotient quotient(pool_scale(p, ptr, h.head, h.is_v));
#pragma unroll
        for (int j = 0; j < kGroups; ++j)
          if (has[j]) store_fp8(x[j], pool + j * W, quotient, p.pool_fp8);
      }
    }
  }
}

template <typename T, bool kFp8>
cudaError_t launch(const RopePoolParams& p, const RopePoolPointers& ptrs, cudaStream_t stream) {
  // The rotation kernel's plan over lanes instead of items: whole warps, at
  // most max_threads, tokens split across blocks below split_below.
  const core::RopeCudaLaunch shape = core::plan_rope_cuda_launch(core::rope_norm_lanes_per_token(p), p.num_tokens);
  const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(shape.splits));
  const dim3 block(shape.threads);
  // (its own task split; the index plan serves the page division)
  const core::RopeCudaIndex ix = core::plan_rope_cuda_index(p, shape.splits, 1);
  if (p.width == 1) return launch_kernel(rope_norm_pool_kernel<T, 1, kFp8>, grid, block, stream, p, ptrs, ix);
  return launch_kernel(rope_norm_pool_kernel<T, 16 / sizeof(T), kFp8>, grid, block, stream, p, ptrs, ix);
}

}  // namespace

cudaError_t rope_norm_pool(const RopePoolParams& params, const RopePoolPointers& ptrs, core::DType dtype,
                           cudaStream_t stream) {
  return with_element_type(dtype, params.pool_fp8 != 0 || params.q_fp8 != 0, [&](auto element, auto fp8) {
    return launch<decltype(element), decltype(fp8)::value>(params, ptrs, stream);
  });
}

}  // namespace attnprep::cuda::rope
