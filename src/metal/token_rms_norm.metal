// qk_norm_rope's per-token QK norm for Apple GPUs, the semantics of src/cuda/token_rms_norm.cu: a threadgroup per
// token; each thread sums the squares of a power-of-two run of the token's elements pairwise, a threadgroup tree
// adds the runs in order, then every element is normalized and weighted. Written in the subset of MSL that is also
// C++, so tests/metal compiles this file unchanged on Linux and runs it over its grid.
#include <metal_stdlib>

#include "token_rms_norm_params.h"

using namespace metal;

// Threads of a threadgroup (core::kTokenNormThreads).
enum : int { kTokenNormThreads = 256 };

inline long token_norm_at(constant TokenNormParams& p, long t, long e, bool out) {
  const long h = e / p.head_dim;
  const long d = e - h * p.head_dim;
  return out ? t * p.out_stride_token + h * p.out_stride_head + d : t * p.x_stride_token + h * p.x_stride_head + d;
}

template <typename T>
kernel void token_rms_norm(device const T* x [[buffer(0)]], device const float* w32 [[buffer(1)]],
                           device const T* wT [[buffer(2)]], device T* out [[buffer(3)]],
                           constant TokenNormParams& p [[buffer(4)]], uint group [[threadgroup_position_in_grid]],
                           uint lid [[thread_position_in_threadgroup]], uint nthreads [[threads_per_threadgroup]]) {
  threadgroup float sums[kTokenNormThreads];
  if (long(group) >= p.tokens) return;  // a padded grid's extra group leaves whole, before any barrier
  const long t = long(group);
  const long n = p.heads * p.head_dim;
  const int run = p.padded > kTokenNormThreads ? p.padded / kTokenNormThreads : 1;  // a power of two
  const int runs = p.padded / run;
  float s = 0.0f;
  if (int(lid) < runs) {
    float stack[26];  // a run of up to 2^24 elements: at most 25 partial sums pending
    int depth = 0;
    for (int i = 0; i < run; ++i) {
      const long e = long(lid) * run + i;
      const float v = e < n ? float(x[token_norm_at(p, t, e, false)]) : 0.0f;
      float q = v * v;
      for (int m = i + 1; (m & 1) == 0; m >>= 1) q = stack[--depth] + q;
      stack[depth++] = q;
    }
    s = stack[0];
  }
  sums[lid] = s;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int stride = 1; stride < runs; stride *= 2) {
    const int i = int(lid);
    if (i % (2 * stride) == 0 && i + stride < runs) sums[i] = sums[i] + sums[i + stride];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  const float inv = precise::divide(1.0f, precise::sqrt(precise::divide(sums[0], float(n)) + p.eps));
  for (long e = long(lid); e < n; e += long(nthreads)) {
    const float w = p.weight_f32 != 0 ? w32[e] : float(wT[e]);
    const float normalized = float(x[token_norm_at(p, t, e, false)]) * inv;
    const float y = p.offset == 0.0f ? float(T(normalized)) * w : normalized * (p.offset + w);
    out[token_norm_at(p, t, e, true)] = T(y);
  }
}

// Stable names, one per dtype: token_rms_norm_half, token_rms_norm_bfloat, token_rms_norm_float.
#ifndef ATTNPREP_HOST_NAME
#define ATTNPREP_HOST_NAME(name) [[host_name(name)]]
#endif
#define ATTNPREP_TOKEN_NORM_INSTANCE(T)                                                                         \
  template ATTNPREP_HOST_NAME("token_rms_norm_" #T) kernel void token_rms_norm<T>(                              \
      device const T* x [[buffer(0)]], device const float* w32 [[buffer(1)]], device const T* wT [[buffer(2)]], \
      device T* out [[buffer(3)]], constant TokenNormParams& p [[buffer(4)]],                                   \
      uint group [[threadgroup_position_in_grid]], uint lid [[thread_position_in_threadgroup]],                 \
      uint nthreads [[threads_per_threadgroup]]);
ATTNPREP_TOKEN_NORM_INSTANCE(half)
ATTNPREP_TOKEN_NORM_INSTANCE(bfloat)
ATTNPREP_TOKEN_NORM_INSTANCE(float)
