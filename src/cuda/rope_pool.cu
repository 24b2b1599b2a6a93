// Fused RoPE + KV-pool write. Each block serves one token (or a slice of
// one): it computes the token's cos/sin table (rotary_dim / 2 entries, shared
// by every head) into shared memory, then its threads walk the token's work
// items: rotate each q and k head, store q_rot/k_rot, and scatter the rotated
// k and the raw v into the pools (paged or flat, in q's dtype or fp8) when the
// token's slot is in [0, pool_size).
#include "cuda/rope_pool.h"

#include "core/angle_sincos.h"
#include "core/rope_pool.h"
#include "cuda/launch.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace attnprep::cuda {
namespace {

using Policy = core::RopeCudaPolicy;
constexpr int kThreads = Policy::max_threads;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// N consecutive elements, moved with one 16-byte access when N elements are
// 16 bytes (the plan guarantees alignment then), else one element at a time.
template <typename T, int N>
struct Group {
  static constexpr bool kVector = N * sizeof(T) == 16;
  T e[N];
  __device__ __forceinline__ void load(const T* p) {
    if constexpr (kVector) {
      *reinterpret_cast<uint4*>(e) = __ldg(reinterpret_cast<const uint4*>(p));
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
};

// N elements of a group, each x / scale rounded to nearest even and saturated
// to the format's finite range, stored as N bytes (one access when N > 1:
// the plan aligns fp8 pool rows to the group size).
template <typename T, int N>
__device__ __forceinline__ void store_fp8(const Group<T, N>& g, unsigned char* dst, float scale, int kind) {
  const __nv_fp8_interpretation_t fmt = kind == 1 ? __NV_E4M3 : __NV_E5M2;
  // packed in registers, four bytes to a word (a local byte array would go to the stack)
  uint32_t word[(N + 3) / 4] = {};
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const uint32_t b = __nv_cvt_float_to_fp8(__fdiv_rn(to_float(g.e[i]), scale), __NV_SATFINITE, fmt);
    word[i / 4] |= b << (8 * (i % 4));
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

__device__ __forceinline__ int64_t read_index(const void* p, int64_t i, int is64) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// One work item: up to two groups of W elements of one head (lo, and hi when
// `two`), where they come from and go to, and which frequencies rotate them.
template <typename T, int W>
struct Item {
  enum Kind { kNeox, kGptj, kCopy };
  Kind kind = kCopy;
  bool is_q = false, is_v = false, two = false;
  int head = 0;
  const T* src = nullptr;
  T* dst = nullptr;   // q_rot/k_rot; null for v and for in-place pass-through
  int lo_off = 0, hi_off = 0, freq = 0;
  Group<T, W> lo, hi;

  // Where item `item` of token t lives. Nothing here waits for the token's
  // position or slot, so the loads that follow overlap that round trip.
  // Item indices are 32-bit: the launcher refuses tokens of 2^30 items.
  __device__ __forceinline__ void locate(const RopePoolParams& p, const RopePoolPointers& ptr, int64_t t,
                                         int item, int n_qk) {
    constexpr int F = W == 1 ? 1 : W / 2;
    const int half = p.rotary_dim / 2;
    // A thread reuses one Item for all its items: reset what a branch below
    // may leave unset.
    is_q = false;
    is_v = false;
    two = false;
    dst = nullptr;
    if (item >= n_qk) {  // v: copied into the pool only
      const int r = item - n_qk;
      head = r / p.v_items_per_head;
      lo_off = (r - head * p.v_items_per_head) * W;
      // Two groups half a head apart when the head's group count is even
      // (core::make_rope_pool_params).
      two = 2 * p.v_items_per_head * W == p.head_dim;
      hi_off = lo_off + p.v_items_per_head * W;
      kind = kCopy;
      is_v = true;
      src = static_cast<const T*>(ptr.v) + t * p.v_stride_token + head * p.v_stride_head;
      return;
    }
    const int qk = p.qk_items_per_head;
    head = item / qk;
    const int sub = item - head * qk;
    is_q = head < p.num_qo_heads;
    if (is_q) {
      src = static_cast<const T*>(ptr.q) + t * p.q_stride_token + head * p.q_stride_head;
      dst = static_cast<T*>(ptr.q_rot) + t * p.qo_stride_token + head * p.qo_stride_head;
    } else {
      head -= p.num_qo_heads;
      src = static_cast<const T*>(ptr.k) + t * p.k_stride_token + head * p.k_stride_head;
      dst = static_cast<T*>(ptr.k_rot) + t * p.ko_stride_token + head * p.ko_stride_head;
    }
    const int rot_items = p.is_neox ? half / W : half / F;
    if (sub >= rot_items) {  // pass-through part of a partial rotary
      kind = kCopy;
      lo_off = p.rotary_dim + (sub - rot_items) * W;
      if (dst == src) dst = nullptr;  // in place: already there
    } else if (p.is_neox) {
      kind = kNeox;
      freq = sub * W;
      lo_off = freq;
      hi_off = half + freq;
      two = true;
    } else {
      kind = kGptj;
      freq = sub * F;
      lo_off = 2 * freq;
      hi_off = lo_off + 1;  // W == 1: the pair's second element in `hi`
      two = W == 1;
    }
  }

  __device__ __forceinline__ void load() {
    lo.load(src + lo_off);
    if (two) hi.load(src + hi_off);
  }
  // Asks L2 for the item's lines now; a later load() then hits L2.
  __device__ __forceinline__ void prefetch() const {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(src + lo_off));
    if (two) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(src + hi_off));
  }
  // kFp8: the pools are float8 (stored x / scale); otherwise T.
  template <bool kFp8>
  __device__ __forceinline__ void finish(const RopePoolParams& p, const RopePoolPointers& ptr, const float2* cs,
                                         int64_t slot, bool write_pool) {
    if (kind == kNeox) {
#pragma unroll
      for (int j = 0; j < W; ++j) rotate(lo.e[j], hi.e[j], cs[freq + j]);
    } else if (kind == kGptj) {
      if constexpr (W == 1) {
        rotate(lo.e[0], hi.e[0], cs[freq]);
      } else {
#pragma unroll
        for (int j = 0; j < W / 2; ++j) rotate(lo.e[2 * j], lo.e[2 * j + 1], cs[freq + j]);
      }
    }
    if (dst) {
      lo.store(dst + lo_off);
      if (two) hi.store(dst + hi_off);
    }
    if (write_pool && !is_q) {
      // slot -> (page, offset): a 32-bit division (a 64-bit one is a
      // stack-using call), as paged pools have fewer than 2^32 slots (checked);
      // recomputed per item rather than held, which would cost registers
      const int64_t page = p.page_size == 1 ? slot
                                            : static_cast<int64_t>(static_cast<uint32_t>(slot) /
                                                                   static_cast<uint32_t>(p.page_size));
      const int64_t offset = slot - page * p.page_size;
      const int64_t row = is_v ? page * p.vp_stride_page + offset * p.vp_stride_offset + head * p.vp_stride_head
                               : page * p.kp_stride_page + offset * p.kp_stride_offset + head * p.kp_stride_head;
      if constexpr (!kFp8) {
        T* pool = static_cast<T*>(is_v ? ptr.v_pool : ptr.k_pool) + row;
        lo.store(pool + lo_off);
        if (two) hi.store(pool + hi_off);
      } else {
        unsigned char* pool = static_cast<unsigned char*>(is_v ? ptr.v_pool : ptr.k_pool) + row;
        const float scale = is_v ? ptr.v_scale[p.v_scale_per_head ? head : 0]
                                 : ptr.k_scale[p.k_scale_per_head ? head : 0];
        store_fp8(lo, pool + lo_off, scale, p.pool_fp8);
        if (two) store_fp8(hi, pool + hi_off, scale, p.pool_fp8);
      }
    }
  }

  // (a, b) -> (a cos - b sin, b cos + a sin) in float32, one rounding to T.
  static __device__ __forceinline__ void rotate(T& a, T& b, float2 r) {
    const float x = to_float(a), y = to_float(b);
    a = from_float<T>(x * r.x - y * r.y);
    b = from_float<T>(y * r.x + x * r.y);
  }
};

// (cos, sin) of frequency i at position pos: from rope_base, or read from
// cos_sin_cache (NaN for a position outside the table, which is never read).
// inv_freq_i is p.inv_freq[i], read by the caller (before the kernel's wait).
__device__ __forceinline__ float2 token_cos_sin(const RopePoolParams& p, const RopePoolPointers& ptr, int64_t pos,
                                                bool pos_ok, int i, float inv_freq_i) {
  float c, s;
  if (!p.use_cache) {
    // float32 angle; sin/cos correctly rounded at any magnitude, with no
    // slow path (core/angle_sincos.h says why not sincosf)
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

// Asks L2 for item `item` of token t (when the block has it).
template <typename T, int W>
__device__ __forceinline__ void prefetch_item(const RopePoolParams& p, const RopePoolPointers& ptr, int64_t t,
                                              int item, int end, int n_qk) {
  if (item < end) {
    Item<T, W> ahead;
    ahead.locate(p, ptr, t, item, n_qk);
    ahead.prefetch();
  }
}

// Block (t, s): token t, the s-th of gridDim.y slices of its work items.
// kAhead: while on an item, ask L2 for the one kAhead rounds later. kFp8: the
// pools are float8 (a separate instantiation: the conversion's registers would
// make the common case spill under the occupancy target).
template <typename T, int W, int kAhead, bool kFp8>
__global__ void __launch_bounds__(kThreads, Policy::min_blocks_per_sm)
    rope_pool_kernel(const __grid_constant__ RopePoolParams p, const RopePoolPointers ptr) {
  __shared__ float2 cs[ATTNPREP_ROPE_MAX_HALF];  // (cos, sin) per frequency
  const int64_t t = blockIdx.x;
  const int half = p.rotary_dim / 2;

  // Parameter arithmetic only up to the wait: with PDL it overlaps the kernel
  // before this one, and it includes the first reads of the parameter bank
  // (cold at each launch) and the divisions that place the first item.
  // Item arithmetic is 32-bit (core bounds the heads, the launcher the
  // items): 64-bit divisions here sit between the launch and the first load.
  const int n_qk = (p.num_qo_heads + p.num_kv_heads) * p.qk_items_per_head;
  const int n_all = n_qk + p.num_kv_heads * p.v_items_per_head;
  const int per_block = (n_all + gridDim.y - 1) / gridDim.y;
  const int end = min(n_all, static_cast<int>(blockIdx.y) * per_block + per_block);
  // One item in flight per thread, its loads issued before the cos/sin table
  // so they overlap that work and the round trip for the position. (Two
  // items in flight need more registers than the occupancy target allows.)
  Item<T, W> it;
  int item = static_cast<int>(blockIdx.y) * per_block + threadIdx.x;
  if (item < end) it.locate(p, ptr, t, item, n_qk);
  const float first_inv_freq = !p.use_cache && static_cast<int>(threadIdx.x) < half ? p.inv_freq[threadIdx.x] : 0.f;

  wait_for_prior_kernels();  // cuda/launch.h: before any global memory access
  // Not at entry, as the copy engine does: the next call's blocks would then
  // take multiprocessor slots this kernel's later tokens still need.
  let_next_kernel_start();
  const int64_t pos = read_index(ptr.positions, t, p.positions_int64);
  const int64_t slot = read_index(ptr.slots, t, p.slots_int64);
  // A position outside cos_sin_cache must not be read: its rows become NaN
  // and its pool write is skipped (check_slots=True reports it on the host).
  const bool pos_ok = !p.use_cache || (pos >= 0 && pos < p.cache_len);
  const bool write_pool = pos_ok && slot >= 0 && slot < p.pool_size;
  if (item < end) it.load();
#pragma unroll
  for (int r = 1; r <= kAhead; ++r) prefetch_item<T, W>(p, ptr, t, item + r * static_cast<int>(blockDim.x), end, n_qk);
  // One table per block, behind one barrier: a table per warp would repeat
  // the cos/sin work, which costs more than the barrier.
  for (int i = threadIdx.x; i < half; i += blockDim.x)
    cs[i] = token_cos_sin(p, ptr, pos, pos_ok, i, i == static_cast<int>(threadIdx.x) ? first_inv_freq : p.inv_freq[i]);
  __syncthreads();
  while (item < end) {
    it.template finish<kFp8>(p, ptr, cs, slot, write_pool);
    item += blockDim.x;
    if (item < end) {
      it.locate(p, ptr, t, item, n_qk);
      it.load();
      if constexpr (kAhead > 0) prefetch_item<T, W>(p, ptr, t, item + kAhead * static_cast<int>(blockDim.x), end, n_qk);
    }
  }
}

template <typename T, bool kFp8>
cudaError_t launch(const RopePoolParams& p, const RopePoolPointers& ptrs, cudaStream_t stream) {
  const core::RopeCudaLaunch shape =
      core::plan_rope_cuda_launch(core::rope_items_per_token(p), p.num_tokens);
  const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(shape.splits));
  const dim3 block(shape.threads);
  if (p.width == 1) return launch_kernel(rope_pool_kernel<T, 1, 0, kFp8>, grid, block, stream, p, ptrs);
  constexpr int V = 16 / sizeof(T);
  // One round per block (small calls, split tokens): nothing to ask for
  // ahead, and the instantiation without the prefetch is leaner.
  if (shape.several_rounds)
    return launch_kernel(rope_pool_kernel<T, V, Policy::prefetch_rounds_ahead, kFp8>, grid, block, stream, p, ptrs);
  return launch_kernel(rope_pool_kernel<T, V, 0, kFp8>, grid, block, stream, p, ptrs);
}

}  // namespace

cudaError_t rope_pool(const RopePoolParams& params, const RopePoolPointers& ptrs, core::DType dtype,
                      cudaStream_t stream) {
  if (params.num_tokens == 0) return cudaSuccess;
  // grid.x holds the tokens; item indices within a token are 32-bit, with
  // room for a block's last round past the token's end.
  if (params.num_tokens >= (int64_t{1} << 31) || core::rope_items_per_token(params) >= (int64_t{1} << 30))
    return cudaErrorInvalidConfiguration;
  const bool fp8 = params.pool_fp8 != 0;
  switch (dtype) {
    case core::DType::Float16: return fp8 ? launch<__half, true>(params, ptrs, stream) : launch<__half, false>(params, ptrs, stream);
    case core::DType::BFloat16:
      return fp8 ? launch<__nv_bfloat16, true>(params, ptrs, stream) : launch<__nv_bfloat16, false>(params, ptrs, stream);
    case core::DType::Float32: return fp8 ? launch<float, true>(params, ptrs, stream) : launch<float, false>(params, ptrs, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace attnprep::cuda
