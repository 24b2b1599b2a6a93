// qk_norm_rope's per-token QK norm: a block per token; each thread sums the squares of a power-of-two run of the
// token's elements pairwise, a shared-memory tree adds the runs in order (together the contract's pairwise sum over
// heads * head_dim padded with zeros), then every element is normalized and weighted as the per-head norm is.
#include "cuda/token_rms_norm.h"

#include "cuda/block_sum.cuh"
#include "cuda/elements.cuh"
#include "cuda/launch.h"
#include "cuda/rcp_sqrt.cuh"
#include "cuda/rope_group.cuh"
#include "cuda/rope_norm.cuh"

namespace attnprep::cuda {
namespace {

constexpr int kThreads = core::kTokenNormThreads;
constexpr int kMaxDepth = 26;  // a run of up to 2^24 elements: at most 25 partial sums pending

template <typename T>
__device__ __forceinline__ const T* element(const T* x, const TokenNormParams& p, int64_t t, int64_t e, bool out) {
  const int64_t h = e / p.head_dim, d = e - h * p.head_dim;
  return x + t * (out ? p.out_stride_token : p.x_stride_token) + h * (out ? p.out_stride_head : p.x_stride_head) + d;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    token_rms_norm_kernel(const TokenNormParams p, const T* x, const void* weight, T* out) {
  __shared__ float sums[kThreads];
  const int64_t t = blockIdx.x;
  const int64_t n = p.heads * p.head_dim;
  const int run = p.padded > kThreads ? p.padded / kThreads : 1;  // a power of two
  const int runs = p.padded / run;
  wait_for_prior_kernels();
  float s = 0.f;
  if (static_cast<int>(threadIdx.x) < runs) {
    // pairwise over the run: a binary counter of completed blocks, as the reference sums
    float stack[kMaxDepth];
    int depth = 0;
    const int64_t first = static_cast<int64_t>(threadIdx.x) * run;
    for (int i = 0; i < run; ++i) {
      const int64_t e = first + i;
      const float v = e < n ? elements::to_float(*element(x, p, t, e, false)) : 0.f;
      float q = __fmul_rn(v, v);
      for (int m = i + 1; (m & 1) == 0; m >>= 1) q = __fadd_rn(stack[--depth], q);
      stack[depth++] = q;
    }
    s = stack[0];
  }
  sums[threadIdx.x] = s;
  __syncthreads();
  for (int stride = 1; stride < runs; stride *= 2) {
    const int i = static_cast<int>(threadIdx.x);
    if (i % (2 * stride) == 0 && i + stride < runs) sums[i] = __fadd_rn(sums[i], sums[i + stride]);
    __syncthreads();
  }
  const float inv = rcp_sqrt_rn(__fadd_rn(__fdiv_rn(sums[0], static_cast<float>(n)), p.eps));
  let_next_kernel_start();
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    const float w =
        p.weight_f32 ? static_cast<const float*>(weight)[e] : elements::to_float(static_cast<const T*>(weight)[e]);
    const float normalized = __fmul_rn(elements::to_float(*element(x, p, t, e, false)), inv);
    const float y = p.offset == 0.f ? __fmul_rn(elements::to_float(elements::from_float<T>(normalized)), w)
                                    : __fmul_rn(normalized, __fadd_rn(p.offset, w));
    *const_cast<T*>(element(static_cast<const T*>(out), p, t, e, true)) = elements::from_float<T>(y);
  }
}

// Where element e of the token's row sits in shared memory: one float of padding every 32, so that threads
// reading runs of a power-of-two length at the same offset fall into different banks.
__device__ __forceinline__ uint32_t skewed(uint32_t e) { return e + (e >> 5); }
constexpr int kStagedMaxFloats = 11 * 1024;  // a row within 44 KB of shared memory, its padding included

// The same arithmetic with the token's row read once, coalesced, into shared memory (rows that fit): the runs and
// the normalization then read it there.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    token_rms_norm_staged_kernel(const TokenNormParams p, const T* x, const void* weight, T* out) {
  extern __shared__ float row[];
  __shared__ float sums[kThreads];
  const int64_t t = blockIdx.x;
  const uint32_t n = static_cast<uint32_t>(p.heads * p.head_dim), D = static_cast<uint32_t>(p.head_dim);
  const int run = p.padded > kThreads ? p.padded / kThreads : 1;
  const int runs = p.padded / run;
  wait_for_prior_kernels();
  const T* xt = x + t * p.x_stride_token;
  for (uint32_t e = threadIdx.x; e < static_cast<uint32_t>(p.padded); e += blockDim.x) {
    float v = 0.f;
    if (e < n) {
      const uint32_t h = e / D;
      v = elements::to_float(xt[h * p.x_stride_head + (e - h * D)]);
    }
    row[skewed(e)] = v;
  }
  __syncthreads();
  float s = 0.f;
  if (static_cast<int>(threadIdx.x) < runs) {
    float stack[kMaxDepth];
    int depth = 0;
    const uint32_t first = threadIdx.x * static_cast<uint32_t>(run);
    for (int i = 0; i < run; ++i) {
      const float v = row[skewed(first + i)];
      float q = __fmul_rn(v, v);
      for (int m = i + 1; (m & 1) == 0; m >>= 1) q = __fadd_rn(stack[--depth], q);
      stack[depth++] = q;
    }
    s = stack[0];
  }
  sums[threadIdx.x] = s;
  __syncthreads();
  for (int stride = 1; stride < runs; stride *= 2) {
    const int i = static_cast<int>(threadIdx.x);
    if (i % (2 * stride) == 0 && i + stride < runs) sums[i] = __fadd_rn(sums[i], sums[i + stride]);
    __syncthreads();
  }
  const float inv = rcp_sqrt_rn(__fadd_rn(__fdiv_rn(sums[0], static_cast<float>(n)), p.eps));
  let_next_kernel_start();
  T* ot = out + t * p.out_stride_token;
  for (uint32_t e = threadIdx.x; e < n; e += blockDim.x) {
    const float w =
        p.weight_f32 ? static_cast<const float*>(weight)[e] : elements::to_float(static_cast<const T*>(weight)[e]);
    const float normalized = __fmul_rn(row[skewed(e)], inv);
    const float y = p.offset == 0.f ? __fmul_rn(elements::to_float(elements::from_float<T>(normalized)), w)
                                    : __fmul_rn(normalized, __fadd_rn(p.offset, w));
    const uint32_t h = e / D;
    ot[h * p.out_stride_head + (e - h * D)] = elements::from_float<T>(y);
  }
}

// The token's row in registers, 16 bytes a thread per round (aligned rows of up to kVectorRounds rounds): the loads
// coalesced and issued together, then the pairwise tree by groups, lanes, warps and rounds (extra zeros add nothing).
constexpr int kVectorRounds = 4;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    token_rms_norm_vector_kernel(const TokenNormParams p, const T* x, const void* weight, T* out) {
  constexpr int G = 16 / sizeof(T);
  constexpr int kWarps = kThreads / 32;
  __shared__ float warp_sums[kVectorRounds][kWarps];
  const int64_t t = blockIdx.x;
  const uint32_t n = static_cast<uint32_t>(p.heads * p.head_dim), D = static_cast<uint32_t>(p.head_dim);
  const int rounds = max(1, p.padded / (kThreads * G));
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) / 32;
  wait_for_prior_kernels();
  rope::Group<T, G> g[kVectorRounds];
  uint32_t at[kVectorRounds];  // the group's first element, n where it holds none
#pragma unroll
  for (int r = 0; r < kVectorRounds; ++r) {
    const uint32_t e = (static_cast<uint32_t>(r) * kThreads + threadIdx.x) * G;
    at[r] = r < rounds && e < n ? e : n;
    if (at[r] < n) {
      const uint32_t h = e / D;
      g[r].load(x + t * p.x_stride_token + h * p.x_stride_head + (e - h * D));
    } else {
#pragma unroll
      for (int i = 0; i < G; ++i) g[r].e[i] = elements::from_float<T>(0.f);
    }
  }
#pragma unroll
  for (int r = 0; r < kVectorRounds; ++r) {
    if (r >= rounds) break;
    float s = rope::group_squares(g[r]);
    for (int off = 1; off < 32; off *= 2) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, off));
    if (lane == 0) warp_sums[r][warp] = s;
  }
  __syncthreads();
  const float sum = block_pairwise_total<kVectorRounds, kWarps>(warp_sums, rounds);
  const float inv = rcp_sqrt_rn(__fadd_rn(__fdiv_rn(sum, static_cast<float>(n)), p.eps));
  let_next_kernel_start();
#pragma unroll
  for (int r = 0; r < kVectorRounds; ++r) {
    if (at[r] >= n) continue;
    const uint32_t e = at[r], h = e / D;
    const auto w = [&](int i) {
      return p.weight_f32 ? static_cast<const float*>(weight)[e + i]
                          : elements::to_float(static_cast<const T*>(weight)[e + i]);
    };
    if (p.offset == 0.f)
      rope::normalize_with<rope::kNormRoundThenWeight>(g[r], w, inv);
    else
      rope::normalize_with<rope::kNormOffsetWeight>(g[r], [&](int i) { return __fadd_rn(p.offset, w(i)); }, inv);
    g[r].store(out + t * p.out_stride_token + h * p.out_stride_head + (e - h * D));
  }
}

// Whether a row can be held in registers: whole 16-byte groups, aligned, within kVectorRounds rounds.
template <typename T>
bool vector_rows(const TokenNormParams& p, const void* x, const void* out) {
  constexpr int G = 16 / sizeof(T);
  const auto aligned = [](const void* a) { return reinterpret_cast<uintptr_t>(a) % 16 == 0; };
  return p.head_dim % G == 0 && p.x_stride_token % G == 0 && p.x_stride_head % G == 0 && p.out_stride_token % G == 0 &&
         p.out_stride_head % G == 0 && aligned(x) && aligned(out) && p.padded <= kVectorRounds * kThreads * G;
}

}  // namespace

cudaError_t token_rms_norm(const TokenNormParams& p, const void* x, const void* weight, void* out, core::DType dtype,
                           cudaStream_t stream) {
  if (p.tokens == 0 || p.heads * p.head_dim == 0) return cudaSuccess;
  if (p.tokens >= (int64_t{1} << 31)) return cudaErrorInvalidConfiguration;
  return rope::with_element_type(dtype, false, [&](auto element, auto) {
    using T = decltype(element);
    if (vector_rows<T>(p, x, out))
      return launch_kernel(token_rms_norm_vector_kernel<T>, dim3(static_cast<unsigned>(p.tokens)), dim3(kThreads),
                           stream, p, static_cast<const T*>(x), weight, static_cast<T*>(out));
    const int floats = p.padded + p.padded / 32;
    if (floats <= kStagedMaxFloats)
      return launch_kernel_shared(token_rms_norm_staged_kernel<T>, dim3(static_cast<unsigned>(p.tokens)),
                                  dim3(kThreads), static_cast<size_t>(floats) * 4, stream, p, static_cast<const T*>(x),
                                  weight, static_cast<T*>(out));
    return launch_kernel(token_rms_norm_kernel<T>, dim3(static_cast<unsigned>(p.tokens)), dim3(kThreads), stream, p,
                         static_cast<const T*>(x), weight, static_cast<T*>(out));
  });
}

}  // namespace attnprep::cuda
