// Fused RoPE + KV-pool write. One block per token: the block first computes
// the token's cos/sin table (rotary_dim / 2 entries, shared by every head)
// into shared memory, then its threads walk the token's work items: rotate
// each q and k head, store q_rot/k_rot, and scatter the rotated k and the raw
// v into the pools when the token's slot is in [0, pool_size).
#include "cuda/rope_pool.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace attnprep::cuda {
namespace {

constexpr int kThreads = 128;

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
  T e[N];
  __device__ __forceinline__ void load(const T* p) {
    if constexpr (N * sizeof(T) == 16) {
      *reinterpret_cast<uint4*>(e) = __ldg(reinterpret_cast<const uint4*>(p));
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) e[i] = p[i];
    }
  }
  __device__ __forceinline__ void store(T* p) const {
    if constexpr (N * sizeof(T) == 16) {
      *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(e);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) p[i] = e[i];
    }
  }
};

__device__ __forceinline__ int64_t read_index(const void* p, int64_t i, int is64) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    rope_pool_kernel(const __grid_constant__ RopePoolParams p, const RopePoolPointers ptr) {
  __shared__ float2 cs[ATTNPREP_ROPE_MAX_HALF];  // (cos, sin) per frequency
  const int64_t t = blockIdx.x;
  const int half = p.rotary_dim / 2;
  const int64_t pos = read_index(ptr.positions, t, p.positions_int64);
  const int64_t slot = read_index(ptr.slots, t, p.slots_int64);
  // A position outside cos_sin_cache must not be read: its rows become NaN
  // and its pool write is skipped (check_slots=True reports it on the host).
  const bool pos_ok = !p.use_cache || (pos >= 0 && pos < p.cache_len);
  const bool write_pool = pos_ok && slot >= 0 && slot < p.pool_size;

  for (int i = threadIdx.x; i < half; i += kThreads) {
    float c, s;
    if (!p.use_cache) {
      // float32 angle, accurate sincosf (no fast-math: angles reach 1e6 rad)
      const float angle = __fmul_rn(static_cast<float>(pos), p.inv_freq[i]);
      sincosf(angle, &s, &c);
    } else if (pos_ok) {
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
    cs[i] = make_float2(c, s);
  }
  __syncthreads();

  // NeoX items rotate W pairs (x[i], x[i + half]); GPT-J items rotate F
  // adjacent pairs (x[2i], x[2i + 1]); the rest of head_dim passes through.
  constexpr int F = W == 1 ? 1 : W / 2;
  const int rot_items = p.is_neox ? half / W : half / F;
  const int qk_items = p.qk_items_per_head;
  const int64_t n_qk = static_cast<int64_t>(p.num_qo_heads + p.num_kv_heads) * qk_items;
  const int64_t n_all = n_qk + static_cast<int64_t>(p.num_kv_heads) * p.v_items_per_head;

  for (int64_t item = threadIdx.x; item < n_all; item += kThreads) {
    if (item >= n_qk) {  // v: copy into the pool
      if (!write_pool) continue;
      const int r = static_cast<int>(item - n_qk);
      const int h = r / p.v_items_per_head, e0 = (r % p.v_items_per_head) * W;
      Group<T, W> x;
      x.load(static_cast<const T*>(ptr.v) + t * p.v_stride_token + h * p.v_stride_head + e0);
      x.store(static_cast<T*>(ptr.v_pool) + slot * p.vp_stride_slot + h * p.vp_stride_head + e0);
      continue;
    }
    int h = static_cast<int>(item / qk_items);
    const int sub = static_cast<int>(item % qk_items);
    const bool is_q = h < p.num_qo_heads;
    const T* src;
    T* dst;
    T* pool = nullptr;
    if (is_q) {
      src = static_cast<const T*>(ptr.q) + t * p.q_stride_token + h * p.q_stride_head;
      dst = static_cast<T*>(ptr.q_rot) + t * p.qo_stride_token + h * p.qo_stride_head;
    } else {
      h -= p.num_qo_heads;
      src = static_cast<const T*>(ptr.k) + t * p.k_stride_token + h * p.k_stride_head;
      dst = static_cast<T*>(ptr.k_rot) + t * p.ko_stride_token + h * p.ko_stride_head;
      if (write_pool) pool = static_cast<T*>(ptr.k_pool) + slot * p.kp_stride_slot + h * p.kp_stride_head;
    }
    if (sub >= rot_items) {  // pass-through part of a partial rotary
      const int e0 = p.rotary_dim + (sub - rot_items) * W;
      Group<T, W> x;
      x.load(src + e0);
      if (dst != src) x.store(dst + e0);
      if (pool) x.store(pool + e0);
    } else if (p.is_neox) {
      const int i0 = sub * W;
      Group<T, W> lo, hi;
      lo.load(src + i0);
      hi.load(src + half + i0);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const float2 r = cs[i0 + j];
        const float a = to_float(lo.e[j]), b = to_float(hi.e[j]);
        lo.e[j] = from_float<T>(a * r.x - b * r.y);
        hi.e[j] = from_float<T>(b * r.x + a * r.y);
      }
      lo.store(dst + i0);
      hi.store(dst + half + i0);
      if (pool) {
        lo.store(pool + i0);
        hi.store(pool + half + i0);
      }
    } else {
      const int i0 = sub * F;
      Group<T, 2 * F> x;
      x.load(src + 2 * i0);
#pragma unroll
      for (int j = 0; j < F; ++j) {
        const float2 r = cs[i0 + j];
        const float a = to_float(x.e[2 * j]), b = to_float(x.e[2 * j + 1]);
        x.e[2 * j] = from_float<T>(a * r.x - b * r.y);
        x.e[2 * j + 1] = from_float<T>(b * r.x + a * r.y);
      }
      x.store(dst + 2 * i0);
      if (pool) x.store(pool + 2 * i0);
    }
  }
}

template <typename T>
cudaError_t launch(const RopePoolParams& p, const RopePoolPointers& ptrs, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.num_tokens));
  if (p.width == 1)
    rope_pool_kernel<T, 1><<<grid, kThreads, 0, stream>>>(p, ptrs);
  else
    rope_pool_kernel<T, 16 / sizeof(T)><<<grid, kThreads, 0, stream>>>(p, ptrs);
  return cudaGetLastError();
}

}  // namespace

cudaError_t rope_pool(const RopePoolParams& params, const RopePoolPointers& ptrs, core::DType dtype,
                      cudaStream_t stream) {
  if (params.num_tokens == 0) return cudaSuccess;
  if (params.num_tokens >= (int64_t{1} << 31)) return cudaErrorInvalidConfiguration;
  switch (dtype) {
    case core::DType::Float16: return launch<__half>(params, ptrs, stream);
    case core::DType::BFloat16: return launch<__nv_bfloat16>(params, ptrs, stream);
    case core::DType::Float32: return launch<float>(params, ptrs, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace attnprep::cuda
