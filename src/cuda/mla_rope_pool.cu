// mla_rope_pool_fused on CUDA: a block per token (split across blocks in small calls). The token's first block
// normalizes kv_c (each thread a power-of-two run of it, a butterfly, then the warps' sums in order: the contract's
// pairwise sum) and writes it to the latent cache; every block rotates its share of q's rope parts and k_pe from a
// cos/sin table in shared memory, copying q's other elements where q_rot is not q.
#include "cuda/mla_rope_pool.h"

#include <cstdint>

#include "core/cuda_tuning.h"
#include "core/fast_divmod.h"
#include "core/mla_rope_pool.h"
#include "cuda/launch.h"
#include "cuda/rcp_sqrt.cuh"
#include "cuda/rope_cos_sin.cuh"
#include "cuda/rope_group.cuh"
#include "cuda/rope_norm.cuh"

namespace attnprep::cuda {
namespace {

using namespace rope;
constexpr int kThreads = core::kMlaThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRun = core::kMlaMaxRank / kThreads;  // kv_c elements a thread holds at most (16)

// The token's slot as (page, offset) of the cache, or nothing to write.
struct Place {
  int64_t pos, page, offset;
  bool pos_ok, write;
};

__device__ __forceinline__ Place token_place(const MlaRopeParams& p, const MlaRopePointers& ptr,
                                             const core::FastDivmod& page_div, int64_t t) {
  Place pl{};
  pl.pos = read_index(ptr.positions, t * p.pos_stride, p.positions_int64);
  const int64_t slot = read_index(ptr.slots, t * p.slots_stride, p.slots_int64);
  pl.pos_ok = !p.use_cache || (pl.pos >= 0 && pl.pos < p.cache_len);
  pl.write = pl.pos_ok && slot >= 0 && slot < p.cache_slots;
  if (pl.write) {
    pl.page = p.page_size == 1 ? slot : static_cast<int64_t>(page_div.div_wide(static_cast<uint32_t>(slot)));
    pl.offset = slot - pl.page * p.page_size;
  }
  return pl;
}

// A group written to a cache row: in T, or x / scale in fp8.
template <typename T, int W>
__device__ __forceinline__ void store_cache(const MlaRopeParams& p, const Group<T, W>& g, void* row, int64_t e,
                                            float scale) {
  if (p.cache_fp8)
    store_fp8(g, static_cast<unsigned char*>(row) + e, core::Fp8Quotient(scale), p.cache_fp8);
  else
    g.store(static_cast<T*>(row) + e);
}

// kv_c of token t, normalized where asked, into its cache row (the block's threads together; a block barrier
// inside when normalizing).
template <typename T, int W>
__device__ __forceinline__ void write_latent(const MlaRopeParams& p, const MlaRopePointers& ptr, int64_t t,
                                             const Place& pl, float* warp_sums) {
  constexpr int kG = kMaxRun / W > 0 ? kMaxRun / W : 1;
  const int run = max(W, p.norm_padded / kThreads);  // a power of two: the thread's elements
  const int first = static_cast<int>(threadIdx.x) * run;
  const T* src = static_cast<const T*>(ptr.kv_c) + t * p.kv_stride;
  Group<T, W> x[kG];
  bool has[kG];
#pragma unroll
  for (int j = 0; j < kG; ++j) {
    has[j] = j * W < run && first + j * W < p.kv_rank;
    if (has[j]) x[j].load(src + first + j * W);
  }
  if (p.norm) {
    float ss = run_squares(x, has);
    for (int off = 1; off < 32; off *= 2) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, off));
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = ss;
    __syncthreads();
    float s[kWarps];
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s[w] = warp_sums[w];
#pragma unroll
    for (int step = 1; step < kWarps; step *= 2)
#pragma unroll
      for (int w = 0; w < kWarps; w += 2 * step) s[w] = __fadd_rn(s[w], s[w + step]);
    const float inv = rcp_sqrt_rn(__fadd_rn(__fdiv_rn(s[0], static_cast<float>(p.kv_rank)), p.norm_eps));
    const bool f32 = p.norm_f32;
#pragma unroll
    for (int j = 0; j < kG; ++j) {
      if (!has[j]) continue;
      const int e0 = first + j * W;
      normalize_with<kNormRoundThenWeight>(
          x[j],
          [&](int i) {
            return f32 ? static_cast<const float*>(ptr.kv_norm_weight)[e0 + i]
                       : to_float(static_cast<const T*>(ptr.kv_norm_weight)[e0 + i]);
          },
          inv);
    }
  }
  const float scale = p.cache_fp8 ? *ptr.cache_scale : 1.f;
  void* row = static_cast<char*>(ptr.kv_cache) +
              (pl.page * p.kv_stride_page + pl.offset * p.kv_stride_offset) * (p.cache_fp8 ? 1 : sizeof(T));
#pragma unroll
  for (int j = 0; j < kG; ++j)
    if (has[j]) store_cache(p, x[j], row, first + j * W, scale);
}

// One rotation item: a rope group (or pair of groups) of a q head or of k_pe, or a copied group of q.
template <typename T, int W>
__device__ __forceinline__ void rotate_item(const MlaRopeParams& p, const MlaRopePointers& ptr, int64_t t,
                                            const Place& pl, const float2* cs, int item, int per_head, int q_items,
                                            int copy_items) {
  const int half = p.rotary_dim / 2;
  const int nope = p.q_dim - p.rotary_dim;
  const bool is_q = item < q_items;
  int head = 0, r = item - q_items;  // r: the rope item within k_pe (then q's head below)
  if (is_q) {
    head = item / per_head;
    r = item - head * per_head - copy_items;
  }
  const T* src = is_q ? static_cast<const T*>(ptr.q) + t * p.q_stride_token + head * p.q_stride_head + nope
                      : static_cast<const T*>(ptr.k_pe) + t * p.pe_stride;
  const int64_t out = is_q ? t * p.qo_stride_token + head * p.qo_stride_head + nope : t * p.pe_out_stride;
  // q_rot in T or fp8, from its start; k_pe_rot in T (element offsets either way)
  const auto store_out = [&](const Group<T, W>& g, int e) {
    if (is_q && p.q_fp8)
      store_fp8(g, static_cast<unsigned char*>(ptr.q_rot) + out + e, core::Fp8Quotient(*ptr.q_scale), 1);
    else
      g.store(static_cast<T*>(is_q ? ptr.q_rot : ptr.k_pe_rot) + out + e);
  };
  if (r < 0) {  // a copied group of q's first `nope` elements
    const int e = (r + copy_items) * W - nope;
    Group<T, W> g;
    g.load(src + e);
    store_out(g, e);
    return;
  }
  // lo/hi: NeoX halves (frequencies f ... f + W - 1), a GPT-J pair of single elements; or one GPT-J group of W / 2
  // pairs (frequencies f ... f + W / 2 - 1)
  const bool two = p.is_neox || W == 1;
  const int f = W == 1 || p.is_neox ? r * W : r * W / 2;
  const int lo_off = p.is_neox ? f : 2 * f, hi_off = p.is_neox ? f + half : 2 * f + 1;
  Group<T, W> lo, hi;
  lo.load(src + lo_off);
  if (two) {
    hi.load(src + hi_off);
#pragma unroll
    for (int i = 0; i < W; ++i) {
      const float a = to_float(lo.e[i]), b = to_float(hi.e[i]);
      lo.e[i] = from_float<T>(rotate_first(a, b, cs[f + i]));
      hi.e[i] = from_float<T>(rotate_second(a, b, cs[f + i]));
    }
  } else {
#pragma unroll
    for (int j = 0; j < W / 2; ++j) {
      const float2 x = lo.get2(j);
      lo.set2(j, rotate_first(x.x, x.y, cs[f + j]), rotate_second(x.x, x.y, cs[f + j]));
    }
  }
  store_out(lo, lo_off);
  if (two) store_out(hi, hi_off);
  if (!is_q && pl.write) {
    const size_t bytes = p.cache_fp8 ? 1 : sizeof(T);
    void* row =
        static_cast<char*>(ptr.kpe_cache) + (pl.page * p.kpe_stride_page + pl.offset * p.kpe_stride_offset) * bytes;
    const float scale = p.cache_fp8 ? *ptr.cache_scale : 1.f;
    store_cache(p, lo, row, lo_off, scale);
    if (two) store_cache(p, hi, row, hi_off, scale);
  }
}

template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    mla_rope_pool_kernel(const __grid_constant__ MlaRopeParams p, const MlaRopePointers ptr,
                         const core::FastDivmod page_div, int items_per_block) {
  __shared__ float2 cs[ATTNPREP_ROPE_MAX_HALF];
  __shared__ float warp_sums[kWarps];
  const int64_t t = blockIdx.x;
  const int half = p.rotary_dim / 2;
  // items of a q head: copied groups (none in place), then rope items (NeoX: W frequencies each, in two groups;
  // GPT-J: W / 2 pairs in one group; one element per group: one pair)
  const int copy_items = p.inplace ? 0 : (p.q_dim - p.rotary_dim) / W;
  const int rope_items = W == 1 || p.is_neox ? half / W : p.rotary_dim / W;
  const int per_head = copy_items + rope_items;
  const int q_items = p.heads * per_head;
  const int n_items = q_items + rope_items;
  wait_for_prior_kernels();
  const Place pl = token_place(p, ptr, page_div, t);
  for (int i = threadIdx.x; i < half; i += blockDim.x)
    cs[i] = token_cos_sin(p, ptr.cos_sin_cache, pl.pos, pl.pos_ok, i, p.inv_freq[i]);
  if (blockIdx.y == 0 && pl.write) write_latent<T, W>(p, ptr, t, pl, warp_sums);
  __syncthreads();
  let_next_kernel_start();
  const int begin = static_cast<int>(blockIdx.y) * items_per_block;
  const int end = min(n_items, begin + items_per_block);
  for (int item = begin + static_cast<int>(threadIdx.x); item < end; item += kThreads)
    rotate_item<T, W>(p, ptr, t, pl, cs, item, per_head, q_items, copy_items);
}

}  // namespace

cudaError_t mla_rope_pool(const MlaRopeParams& p, const MlaRopePointers& ptrs, core::DType dtype, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.num_tokens >= (int64_t{1} << 31)) return cudaErrorInvalidConfiguration;
  const core::FastDivmod page_div(static_cast<uint32_t>(p.cache_slots > 0 ? p.page_size : 1));
  return with_element_type(dtype, false, [&](auto element, auto) {
    using T = decltype(element);
    constexpr int V = 16 / sizeof(T);
    const int W = p.width;
    const int half = p.rotary_dim / 2;
    const int64_t per_head =
        (p.inplace ? 0 : (p.q_dim - p.rotary_dim) / W) + (W == 1 || p.is_neox ? half / W : p.rotary_dim / W);
    const int64_t items = (int64_t{p.heads} + 1) * per_head;
    // small calls: a token's items over several blocks, a round of the block's threads each
    const int64_t rounds = (items + kThreads - 1) / kThreads;
    const int64_t splits = p.num_tokens >= core::RopeCudaPolicy::split_below ? 1 : (rounds < 65535 ? rounds : 65535);
    const int per_block = static_cast<int>((items + splits - 1) / splits);
    const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(splits));
    if (W == V)
      return launch_kernel(mla_rope_pool_kernel<T, V>, grid, dim3(kThreads), stream, p, ptrs, page_div, per_block);
    return launch_kernel(mla_rope_pool_kernel<T, 1>, grid, dim3(kThreads), stream, p, ptrs, page_div, per_block);
  });
}

}  // namespace attnprep::cuda
