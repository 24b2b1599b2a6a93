// Fused RoPE + KV-pool write for Apple GPUs, the semantics of src/cuda/rope_pool_kernel.cuh: a threadgroup per token
// builds its cos/sin table, then its threads walk the rotation pairs, pass-through and v elements. Written in the
// subset of MSL that is also C++, so tests/metal compiles this file unchanged on Linux and runs it over its grid.
#include <metal_stdlib>

#include "rope_pool_params.h"

using namespace metal;

// positions/slots arrive as 32-bit words; an int64 entry is two words, low first.
inline long rope_read_index(device const int* words, long i, int is64) {
  if (is64 != 0) return long(uint(words[2 * i])) | (long(words[2 * i + 1]) << 32);
  return long(words[i]);
}

inline float rope_cache_value(device const float* cache32, device const ushort* cache16, int is_bf16, long i) {
  if (is_bf16 != 0) return as_type<float>(uint(cache16[i]) << 16);
  return cache32[i];
}

// (cos, sin) of frequency i at position pos, as the CUDA kernels' token_cos_sin: from inv_freq (precise trig, never
// the fast variants: angles reach 1e6 rad), or the table row (NaN for a position outside it, which is never read).
// P: RopePoolParams or MlaRopeParams.
struct RopeCosSin {
  float c, s;
};
template <typename P>
inline RopeCosSin rope_cos_sin(constant P& p, long pos, bool pos_ok, int i, device const float* cache32,
                               device const ushort* cache16) {
  RopeCosSin r;
  if (p.use_cache == 0) {
    const float angle = float(pos) * p.inv_freq[i];
    r.c = precise::cos(angle);
    r.s = precise::sin(angle);
  } else if (pos_ok) {
    r.c = rope_cache_value(cache32, cache16, p.cache_bf16, pos * p.cache_stride + i);
    r.s = rope_cache_value(cache32, cache16, p.cache_bf16, pos * p.cache_stride + p.rotary_dim / 2 + i);
  } else {
    r.c = as_type<float>(0x7fc00000u);
    r.s = r.c;
  }
  return r;
}

template <typename T>
inline void rope_store(device T* base, long i, float value) {
  base[i] = T(value);
}

// The QK norm: 1 / sqrt(mean of squares + eps) of one head, squares summed pairwise over head_dim padded with zeros
// (a binary counter of power-of-two blocks, leftovers added from the smallest, as the padded tree sums them).
template <typename T>
inline float rope_head_inv(device const T* x, long base, int D, float eps) {
  float stack[12];  // head_dim <= 512, kv_lora_rank <= 2048: at most 12 blocks pending
  int depth = 0;
  for (int d = 0; d < D; ++d) {
    const float f = float(x[base + d]);
    float s = f * f;
    for (int m = d + 1; (m & 1) == 0; m >>= 1) s = stack[--depth] + s;
    stack[depth++] = s;
  }
  float ss = stack[--depth];
  while (depth > 0) ss = stack[--depth] + ss;
  return precise::divide(1.0f, precise::sqrt(precise::divide(ss, float(D)) + eps));
}

// One element normalized: weight * T(x inv) (offset 0, Llama/Qwen3), else
// (offset + weight) * x inv (Gemma), rounded to T.
template <typename T>
inline float rope_norm_value(float x, float inv, float w, float offset) {
  const float n = x * inv;
  if (offset == 0.0f) {
    const float rounded = float(T(n));
    return float(T(rounded * w));
  }
  const float scale = offset + w;
  return float(T(n * scale));
}

// Element e of a q/k head, normalized when the head is (norm factor inv,
// weight as float32 or T).
template <typename T>
inline float rope_read_value(device const T* in, long src, int e, bool normed, float inv, bool w_f32,
                             device const float* w32, device const T* wT, float offset) {
  const float x = float(in[src + e]);
  if (!normed) return x;
  return rope_norm_value<T>(x, inv, w_f32 ? w32[e] : float(wT[e]), offset);
}

// Heads whose norm factors one threadgroup holds at a time.
enum : int { kRopeNormChunk = 256 };

template <typename T>
kernel void rope_pool(device const T* q [[buffer(0)]], device const T* k [[buffer(1)]], device const T* v [[buffer(2)]],
                      device T* q_rot [[buffer(3)]], device T* k_rot [[buffer(4)]], device T* k_pool [[buffer(5)]],
                      device T* v_pool [[buffer(6)]], device const int* positions [[buffer(7)]],
                      device const int* slots [[buffer(8)]], device const float* cache32 [[buffer(9)]],
                      device const ushort* cache16 [[buffer(10)]], constant RopePoolParams& p [[buffer(11)]],
                      device const float* qw32 [[buffer(12)]], device const T* qwT [[buffer(13)]],
                      device const float* kw32 [[buffer(14)]], device const T* kwT [[buffer(15)]],
                      uint group [[threadgroup_position_in_grid]], uint lid [[thread_position_in_threadgroup]],
                      uint nthreads [[threads_per_threadgroup]]) {
  threadgroup float cos_t[ATTNPREP_ROPE_MAX_HALF];
  threadgroup float sin_t[ATTNPREP_ROPE_MAX_HALF];
  threadgroup float inv_t[kRopeNormChunk];  // norm factors of the current chunk of q/k heads
  // A padded grid may hold more groups than tokens: such a group leaves as a
  // whole, before any barrier.
  if (long(group) >= p.num_tokens) return;
  const long t = long(group);
  const int half_rot = p.rotary_dim / 2;
  // M-RoPE: positions [3, T], frequency i rotated by its axis's position
  long axis_pos[3];
  bool pos_ok = true;
  for (int axis = 0; axis < 3; ++axis) {
    const long at = (p.mrope != 0 ? long(axis) * p.pos_stride_axis : 0) + t * p.pos_stride_token;
    axis_pos[axis] = p.positions_kind == 2 ? t : rope_read_index(positions, at, p.positions_kind);
    pos_ok = pos_ok && (p.use_cache == 0 || (axis_pos[axis] >= 0 && axis_pos[axis] < p.cache_len));
  }
  const long slot = rope_read_index(slots, t * p.slots_stride, p.slots_int64);
  const bool write_pool = pos_ok && slot >= 0 && slot < p.pool_size;
  // slot -> (page, offset) of a paged pool; a flat pool is pages of one slot.
  // Only for a slot in the pool: a pool of empty pages has page_size 0.
  const long page = write_pool ? slot / p.page_size : 0;
  const long offset = slot - page * p.page_size;
  const long k_row = page * p.kp_stride_page + offset * p.kp_stride_offset;
  const long v_row = page * p.vp_stride_page + offset * p.vp_stride_offset;

  for (int i = int(lid); i < half_rot; i += int(nthreads)) {
    const long pos =
        p.mrope == 0
            ? axis_pos[0]
            : axis_pos[rope_mrope_axis(p.mrope, p.mrope_section[0], p.mrope_section[1], p.mrope_section[2], i)];
    const RopeCosSin r = rope_cos_sin(p, pos, pos_ok, i, cache32, cache16);
    cos_t[i] = r.c;
    sin_t[i] = r.s;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const int D = p.head_dim;
  const int pass = D - p.rotary_dim;
  const int per_qk_head = half_rot + pass;  // rotation pairs + passed-through elements
  const int qk_heads = p.num_qo_heads + p.num_kv_heads;
  // q and k heads, a chunk at a time: the chunk's norm factors first (one
  // thread per head), then its items
  for (int h0 = 0; h0 < qk_heads; h0 += kRopeNormChunk) {
    const int chunk = min(int(kRopeNormChunk), qk_heads - h0);
    if (p.norm_q != 0 || p.norm_k != 0) {
      for (int c = int(lid); c < chunk; c += int(nthreads)) {
        const int h = h0 + c;
        const bool is_q = h < p.num_qo_heads;
        const bool normed = is_q ? p.norm_q != 0 : p.norm_k != 0;
        const long src = is_q ? t * p.q_stride_token + long(h) * p.q_stride_head
                              : t * p.k_stride_token + long(h - p.num_qo_heads) * p.k_stride_head;
        inv_t[c] = normed ? rope_head_inv(is_q ? q : k, src, D, p.norm_eps) : 0.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    for (long item = long(lid); item < long(chunk) * per_qk_head; item += long(nthreads)) {
      const int c = int(item / per_qk_head);
      const int sub = int(item - long(c) * per_qk_head);
      const bool is_q = h0 + c < p.num_qo_heads;
      const long h = is_q ? h0 + c : h0 + c - p.num_qo_heads;
      const long src = is_q ? t * p.q_stride_token + h * p.q_stride_head : t * p.k_stride_token + h * p.k_stride_head;
      const long dst =
          is_q ? t * p.qo_stride_token + h * p.qo_stride_head : t * p.ko_stride_token + h * p.ko_stride_head;
      const long pool = k_row + h * p.kp_stride_head;
      device const T* in = is_q ? q : k;
      device T* out = is_q ? q_rot : k_rot;
      const bool to_pool = !is_q && write_pool;
      const bool normed = is_q ? p.norm_q != 0 : p.norm_k != 0;
      const bool w_f32 = is_q ? p.q_norm_f32 != 0 : p.k_norm_f32 != 0;
      device const float* w32 = is_q ? qw32 : kw32;
      device const T* wT = is_q ? qwT : kwT;
      const float inv = normed ? inv_t[c] : 0.0f;
      if (sub >= half_rot) {  // pass-through
        const int e = p.rotary_dim + (sub - half_rot);
        const float x = rope_read_value(in, src, e, normed, inv, w_f32, w32, wT, p.norm_offset);
        rope_store(out, dst + e, x);
        if (to_pool) rope_store(k_pool, pool + e, x);
        continue;
      }
      const int e1 = p.is_neox != 0 ? sub : 2 * sub;
      const int e2 = p.is_neox != 0 ? sub + half_rot : 2 * sub + 1;
      const float a = rope_read_value(in, src, e1, normed, inv, w_f32, w32, wT, p.norm_offset);
      const float b = rope_read_value(in, src, e2, normed, inv, w_f32, w32, wT, p.norm_offset);
      const float c_ = cos_t[sub];
      const float s_ = sin_t[sub];
      const float r1 = fma(a, c_, -(b * s_));
      const float r2 = fma(b, c_, a * s_);
      rope_store(out, dst + e1, r1);
      rope_store(out, dst + e2, r2);
      if (to_pool) {
        rope_store(k_pool, pool + e1, r1);
        rope_store(k_pool, pool + e2, r2);
      }
    }
    // the next chunk's factors overwrite inv_t
    if (p.norm_q != 0 || p.norm_k != 0) threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  // v heads, one element at a time, into the pool
  if (!write_pool) return;
  for (long r = long(lid); r < long(p.num_kv_heads) * D; r += long(nthreads)) {
    const long h = r / D;
    const long e = r - h * D;
    const float x = float(v[t * p.v_stride_token + h * p.v_stride_head + e]);
    rope_store(v_pool, v_row + h * p.vp_stride_head + e, x);
  }
}

// Stable names, one per dtype: rope_pool_half, rope_pool_bfloat, rope_pool_float.
// (The Linux test shim, where [[host_name]] is no C++, defines ATTNPREP_HOST_NAME away.)
#ifndef ATTNPREP_HOST_NAME
#define ATTNPREP_HOST_NAME(name) [[host_name(name)]]
#endif
#define ATTNPREP_ROPE_POOL_INSTANCE(T)                                                                   \
  template ATTNPREP_HOST_NAME("rope_pool_" #T) kernel void rope_pool<T>(                                 \
      device const T* q [[buffer(0)]], device const T* k [[buffer(1)]], device const T* v [[buffer(2)]], \
      device T* q_rot [[buffer(3)]], device T* k_rot [[buffer(4)]], device T* k_pool [[buffer(5)]],      \
      device T* v_pool [[buffer(6)]], device const int* positions [[buffer(7)]],                         \
      device const int* slots [[buffer(8)]], device const float* cache32 [[buffer(9)]],                  \
      device const ushort* cache16 [[buffer(10)]], constant RopePoolParams& p [[buffer(11)]],            \
      device const float* qw32 [[buffer(12)]], device const T* qwT [[buffer(13)]],                       \
      device const float* kw32 [[buffer(14)]], device const T* kwT [[buffer(15)]],                       \
      uint group [[threadgroup_position_in_grid]], uint lid [[thread_position_in_threadgroup]],          \
      uint nthreads [[threads_per_threadgroup]]);

ATTNPREP_ROPE_POOL_INSTANCE(half)
ATTNPREP_ROPE_POOL_INSTANCE(bfloat)
ATTNPREP_ROPE_POOL_INSTANCE(float)

// mla_rope_pool_fused for Apple GPUs, the semantics of src/cuda/mla_rope_pool.cu: a threadgroup per token builds its
// cos/sin table and kv_c's norm factor, writes the latent row, then its threads walk the rotation pairs of q's rope
// parts and of k_pe, then q's other elements where q_rot is not q. Caches and q_rot in the model's dtype.
template <typename T>
kernel void mla_rope_pool(device const T* q [[buffer(0)]], device const T* kv_c [[buffer(1)]],
                          device const T* k_pe [[buffer(2)]], device T* q_rot [[buffer(3)]],
                          device T* k_pe_rot [[buffer(4)]], device T* kv_cache [[buffer(5)]],
                          device T* kpe_cache [[buffer(6)]], device const int* positions [[buffer(7)]],
                          device const int* slots [[buffer(8)]], device const float* cache32 [[buffer(9)]],
                          device const ushort* cache16 [[buffer(10)]], constant MlaRopeParams& p [[buffer(11)]],
                          device const float* w32 [[buffer(12)]], device const T* wT [[buffer(13)]],
                          uint group [[threadgroup_position_in_grid]], uint lid [[thread_position_in_threadgroup]],
                          uint nthreads [[threads_per_threadgroup]]) {
  threadgroup float cos_t[ATTNPREP_ROPE_MAX_HALF];
  threadgroup float sin_t[ATTNPREP_ROPE_MAX_HALF];
  threadgroup float inv_t[1];
  if (long(group) >= p.num_tokens) return;  // a padded grid's extra group leaves whole, before any barrier
  const long t = long(group);
  const int half_rot = p.rotary_dim / 2;
  const long pos = rope_read_index(positions, t * p.pos_stride, p.positions_int64);
  const bool pos_ok = p.use_cache == 0 || (pos >= 0 && pos < p.cache_len);
  const long slot = rope_read_index(slots, t * p.slots_stride, p.slots_int64);
  const bool write = pos_ok && slot >= 0 && slot < p.cache_slots;
  const long page = write ? slot / p.page_size : 0;
  const long offset = slot - page * p.page_size;
  for (int i = int(lid); i < half_rot; i += int(nthreads)) {
    const RopeCosSin r = rope_cos_sin(p, pos, pos_ok, i, cache32, cache16);
    cos_t[i] = r.c;
    sin_t[i] = r.s;
  }
  if (lid == 0 && write && p.norm != 0) inv_t[0] = rope_head_inv(kv_c, t * p.kv_stride, p.kv_rank, p.norm_eps);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (write) {  // the latent row: kv_c, normalized where asked
    const long row = page * p.kv_stride_page + offset * p.kv_stride_offset;
    for (int e = int(lid); e < p.kv_rank; e += int(nthreads)) {
      const float x = float(kv_c[t * p.kv_stride + e]);
      const float w = p.norm_f32 != 0 ? w32[e] : float(wT[e]);
      rope_store(kv_cache, row + e, p.norm != 0 ? rope_norm_value<T>(x, inv_t[0], w, 0.0f) : x);
    }
  }
  const int nope = p.q_dim - p.rotary_dim;
  const long pe_row = page * p.kpe_stride_page + offset * p.kpe_stride_offset;
  // rotation pairs: every q head's, then k_pe's
  for (long item = long(lid); item < long(p.heads + 1) * half_rot; item += long(nthreads)) {
    const long h = item / half_rot;
    const int i = int(item - h * half_rot);
    const bool is_q = h < p.heads;
    device const T* in = is_q ? q + t * p.q_stride_token + h * p.q_stride_head + nope : k_pe + t * p.pe_stride;
    device T* out = is_q ? q_rot + t * p.qo_stride_token + h * p.qo_stride_head + nope : k_pe_rot + t * p.pe_out_stride;
    const int e1 = p.is_neox != 0 ? i : 2 * i;
    const int e2 = p.is_neox != 0 ? i + half_rot : 2 * i + 1;
    const float a = float(in[e1]);
    const float b = float(in[e2]);
    const float r1 = fma(a, cos_t[i], -(b * sin_t[i]));
    const float r2 = fma(b, cos_t[i], a * sin_t[i]);
    rope_store(out, e1, r1);
    rope_store(out, e2, r2);
    if (!is_q && write) {
      rope_store(kpe_cache, pe_row + e1, r1);
      rope_store(kpe_cache, pe_row + e2, r2);
    }
  }
  if (p.inplace != 0) return;
  for (long item = long(lid); item < long(p.heads) * nope; item += long(nthreads)) {  // q's first `nope` elements
    const long h = item / nope;
    const long e = item - h * nope;
    rope_store(q_rot, t * p.qo_stride_token + h * p.qo_stride_head + e,
               float(q[t * p.q_stride_token + h * p.q_stride_head + e]));
  }
}

// Stable names, one per dtype: mla_rope_pool_half, mla_rope_pool_bfloat, mla_rope_pool_float.
#define ATTNPREP_MLA_ROPE_POOL_INSTANCE(T)                                                                     \
  template ATTNPREP_HOST_NAME("mla_rope_pool_" #T) kernel void mla_rope_pool<T>(                               \
      device const T* q [[buffer(0)]], device const T* kv_c [[buffer(1)]], device const T* k_pe [[buffer(2)]], \
      device T* q_rot [[buffer(3)]], device T* k_pe_rot [[buffer(4)]], device T* kv_cache [[buffer(5)]],       \
      device T* kpe_cache [[buffer(6)]], device const int* positions [[buffer(7)]],                            \
      device const int* slots [[buffer(8)]], device const float* cache32 [[buffer(9)]],                        \
      device const ushort* cache16 [[buffer(10)]], constant MlaRopeParams& p [[buffer(11)]],                   \
      device const float* w32 [[buffer(12)]], device const T* wT [[buffer(13)]],                               \
      uint group [[threadgroup_position_in_grid]], uint lid [[thread_position_in_threadgroup]],                \
      uint nthreads [[threads_per_threadgroup]]);

ATTNPREP_MLA_ROPE_POOL_INSTANCE(half)
ATTNPREP_MLA_ROPE_POOL_INSTANCE(bfloat)
ATTNPREP_MLA_ROPE_POOL_INSTANCE(float)
