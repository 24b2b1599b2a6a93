// mla_rope_pool_fused on CUDA: a warp per token (a token's items over several warps in small calls), with no block
// barrier. Each lane loads its batch of items and its run of kv_c before the token's position is known, the warp
// builds the token's cos/sin table in its own shared memory, normalizes kv_c (each lane's run summed pairwise, then a
// butterfly: the contract's pairwise sum) into the latent cache, and rotates its items.
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
using Policy = core::MlaCudaPolicy;
constexpr int kThreads = core::kMlaThreads;
constexpr int kWarps = kThreads / 32;  // tokens (or token parts) per block

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

// kv_c of token t, a lane's power-of-two run of it: held in registers up to Policy::latent_run elements (L <= 512),
// a longer run summed chunk by chunk (pairwise, so the same tree) and read again to be written.
template <typename T, int W>
struct Latent {
  static constexpr int kChunk = Policy::latent_run < W ? W : Policy::latent_run;
  static constexpr int kG = kChunk / W;
  static constexpr int kMaxChunks = core::kMlaMaxRank / 32 / kChunk > 1 ? core::kMlaMaxRank / 32 / kChunk : 1;
  Group<T, W> x[kG];
  bool has[kG];
  int first = 0, chunk = 0, chunks = 0;
  const T* src = nullptr;

  __device__ __forceinline__ void load_chunk(const MlaRopeParams& p, int c) {
#pragma unroll
    for (int j = 0; j < kG; ++j) {
      const int e = first + c * chunk + j * W;
      has[j] = j * W < chunk && e < p.kv_rank;
      if (has[j]) x[j].load(src + e);
    }
  }

  __device__ __forceinline__ void load(const MlaRopeParams& p, const MlaRopePointers& ptr, int64_t t, int lane) {
    const int run = max(W, p.norm_padded / 32);
    chunk = min(run, kChunk);
    chunks = run / chunk;
    first = lane * run;
    src = static_cast<const T*>(ptr.kv_c) + t * p.kv_stride;
    load_chunk(p, 0);
  }

  __device__ __forceinline__ void write(const MlaRopeParams& p, const MlaRopePointers& ptr, const Place& pl) {
    float inv = 1.f;
    if (p.norm) {
      float part[kMaxChunks];
#pragma unroll
      for (int c = 0; c < kMaxChunks; ++c) {
        if (c > 0 && c < chunks) load_chunk(p, c);
        part[c] = c < chunks ? run_squares(x, has) : 0.f;  // absent chunks add exact zeros
      }
#pragma unroll
      for (int step = 1; step < kMaxChunks; step *= 2)
#pragma unroll
        for (int c = 0; c < kMaxChunks; c += 2 * step) part[c] = __fadd_rn(part[c], part[c + step]);
      float ss = part[0];
      for (int off = 1; off < 32; off *= 2) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, off));
      inv = rcp_sqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(p.kv_rank)), p.norm_eps));
    }
    const float scale = p.cache_fp8 ? *ptr.cache_scale : 1.f;
    void* row = static_cast<char*>(ptr.kv_cache) +
                (pl.page * p.kv_stride_page + pl.offset * p.kv_stride_offset) * (p.cache_fp8 ? 1 : sizeof(T));
    const bool f32 = p.norm_f32;
    for (int c = 0; c < chunks; ++c) {
      if (chunks > 1 && (p.norm || c > 0)) load_chunk(p, c);
#pragma unroll
      for (int j = 0; j < kG; ++j) {
        if (!has[j]) continue;
        const int e0 = first + c * chunk + j * W;
        if (p.norm)
          normalize_with<kNormRoundThenWeight>(
              x[j],
              [&](int i) {
                return f32 ? static_cast<const float*>(ptr.kv_norm_weight)[e0 + i]
                           : to_float(static_cast<const T*>(ptr.kv_norm_weight)[e0 + i]);
              },
              inv);
        store_cache(p, x[j], row, e0, scale);
      }
    }
  }
};

// The items of a token: per q head, its copied groups (none in place), then its rope items (NeoX: W frequencies in
// two groups; GPT-J: W / 2 pairs in one group; single elements: a pair in two groups); then k_pe's rope items.
struct Items {
  int copy, rope, per_head, q, n;
  core::FastDivmod head_div;
};

// Where item `item` reads and writes (element offsets from q / k_pe and q_rot / k_pe_rot) and what it is.
template <int W, bool kTwo>
struct Where {
  int64_t src, out;
  int f, lo, hi;
  bool is_q, copy;

  __device__ __forceinline__ Where(const MlaRopeParams& p, const Items& n, int64_t t, int item) {
    const int half = p.rotary_dim / 2;
    const int nope = p.q_dim - p.rotary_dim;
    is_q = item < n.q;
    int r = item - n.q;  // the rope item within k_pe, or within q's head below
    int head = 0;
    if (is_q) {
      head = static_cast<int>(n.head_div.div(static_cast<uint32_t>(item)));
      r = item - head * n.per_head - n.copy;
    }
    src = is_q ? t * p.q_stride_token + head * p.q_stride_head + nope : t * p.pe_stride;
    out = is_q ? t * p.qo_stride_token + head * p.qo_stride_head + nope : t * p.pe_out_stride;
    copy = r < 0;
    f = kTwo ? r * W : r * W / 2;
    lo = copy ? (r + n.copy) * W - nope : (p.is_neox ? f : 2 * f);
    hi = p.is_neox ? f + half : 2 * f + 1;
  }
};

// A lane's batch: up to kB items, loaded together, then rotated and stored.
template <typename T, int W, bool kTwo>
struct Batch {
  static constexpr int kB = Policy::batch_groups / (kTwo ? 2 : 1);
  Group<T, W> lo[kB], hi[kB];

  __device__ __forceinline__ void load(const MlaRopeParams& p, const MlaRopePointers& ptr, const Items& n, int64_t t,
                                       int base, int end) {
#pragma unroll
    for (int j = 0; j < kB; ++j) {
      const int item = base + j * 32;
      if (item >= end) break;
      const Where<W, kTwo> w(p, n, t, item);
      const T* src = static_cast<const T*>(w.is_q ? ptr.q : ptr.k_pe) + w.src;
      lo[j].load(src + w.lo);
      if (kTwo && !w.copy) hi[j].load(src + w.hi);
    }
  }

  __device__ __forceinline__ void finish(const MlaRopeParams& p, const MlaRopePointers& ptr, const Items& n, int64_t t,
                                         int base, int end, const Place& pl, const float2* cs) {
#pragma unroll
    for (int j = 0; j < kB; ++j) {
      const int item = base + j * 32;
      if (item >= end) break;
      const Where<W, kTwo> w(p, n, t, item);
      // q_rot in T or fp8, from its start; k_pe_rot in T (element offsets either way)
      const auto store_out = [&](const Group<T, W>& g, int e) {
        if (w.is_q && p.q_fp8)
          store_fp8(g, static_cast<unsigned char*>(ptr.q_rot) + w.out + e, core::Fp8Quotient(*ptr.q_scale), 1);
        else
          g.store(static_cast<T*>(w.is_q ? ptr.q_rot : ptr.k_pe_rot) + w.out + e);
      };
      if (w.copy) {
        store_out(lo[j], w.lo);
        continue;
      }
      if constexpr (kTwo) {
#pragma unroll
        for (int i = 0; i < W; ++i) {
          const float a = to_float(lo[j].e[i]), b = to_float(hi[j].e[i]);
          lo[j].e[i] = from_float<T>(rotate_first(a, b, cs[w.f + i]));
          hi[j].e[i] = from_float<T>(rotate_second(a, b, cs[w.f + i]));
        }
      } else {
#pragma unroll
        for (int i = 0; i < W / 2; ++i) {
          const float2 x = lo[j].get2(i);
          lo[j].set2(i, rotate_first(x.x, x.y, cs[w.f + i]), rotate_second(x.x, x.y, cs[w.f + i]));
        }
      }
      store_out(lo[j], w.lo);
      if (kTwo) store_out(hi[j], w.hi);
      if (!w.is_q && pl.write) {
        const size_t bytes = p.cache_fp8 ? 1 : sizeof(T);
        void* row =
            static_cast<char*>(ptr.kpe_cache) + (pl.page * p.kpe_stride_page + pl.offset * p.kpe_stride_offset) * bytes;
        const float scale = p.cache_fp8 ? *ptr.cache_scale : 1.f;
        store_cache(p, lo[j], row, w.lo, scale);
        if (kTwo) store_cache(p, hi[j], row, w.hi, scale);
      }
    }
  }
};

template <typename T, int W, bool kTwo>
__global__ void __launch_bounds__(kThreads, Policy::min_blocks_per_sm)
    mla_rope_pool_kernel(const __grid_constant__ MlaRopeParams p, const MlaRopePointers ptr,
                         const core::FastDivmod page_div, const Items n, int splits, int per_part) {
  __shared__ float2 cs_all[kWarps][ATTNPREP_ROPE_MAX_HALF];
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t unit = int64_t{blockIdx.x} * kWarps + warp;  // (token, part)
  if (unit >= p.num_tokens * splits) return;
  const int64_t t = unit / splits;
  const int part = static_cast<int>(unit - t * splits);
  const int begin = part * per_part;
  const int end = min(n.n, begin + per_part);
  constexpr int kSpan = Batch<T, W, kTwo>::kB * 32;  // items of one batch of the warp
  float2* cs = cs_all[warp];
  wait_for_prior_kernels();
  // The data first: its round trips overlap the position's and the table's.
  Batch<T, W, kTwo> batch;
  batch.load(p, ptr, n, t, begin + lane, end);
  Latent<T, W> kv;
  if (part == 0) kv.load(p, ptr, t, lane);
  const Place pl = token_place(p, ptr, page_div, t);
  const int half = p.rotary_dim / 2;
  for (int i = lane; i < half; i += 32)
    cs[i] = token_cos_sin(p, ptr.cos_sin_cache, pl.pos, pl.pos_ok, i, p.inv_freq[i]);
  __syncwarp();
  let_next_kernel_start();
  if (part == 0 && pl.write) kv.write(p, ptr, pl);
  batch.finish(p, ptr, n, t, begin + lane, end, pl, cs);
  for (int base = begin + kSpan; base < end; base += kSpan) {
    batch.load(p, ptr, n, t, base + lane, end);
    batch.finish(p, ptr, n, t, base + lane, end, pl, cs);
  }
}

template <typename T, int W, bool kTwo>
cudaError_t launch(const MlaRopeParams& p, const MlaRopePointers& ptrs, const core::FastDivmod& page_div,
                   cudaStream_t stream) {
  const int half = p.rotary_dim / 2;
  Items n{};
  n.copy = p.inplace ? 0 : (p.q_dim - p.rotary_dim) / W;
  n.rope = kTwo ? half / W : p.rotary_dim / W;
  n.per_head = n.copy + n.rope;
  n.q = p.heads * n.per_head;
  n.n = n.q + n.rope;
  n.head_div = core::FastDivmod(static_cast<uint32_t>(n.per_head));
  // small calls: a token's items over several warps, one item a lane (a warp walking a whole token is bound by its
  // own instruction latency there)
  const int splits = p.num_tokens >= Policy::split_below ? 1 : (n.n + 31) / 32;
  const int per_part = ((n.n + splits - 1) / splits + 31) / 32 * 32;
  const int64_t units = p.num_tokens * splits;
  const dim3 grid(static_cast<unsigned>((units + kWarps - 1) / kWarps));
  return launch_kernel(mla_rope_pool_kernel<T, W, kTwo>, grid, dim3(kThreads), stream, p, ptrs, page_div, n, splits,
                       per_part);
}

}  // namespace

cudaError_t mla_rope_pool(const MlaRopeParams& p, const MlaRopePointers& ptrs, core::DType dtype, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.num_tokens >= (int64_t{1} << 31)) return cudaErrorInvalidConfiguration;
  const core::FastDivmod page_div(static_cast<uint32_t>(p.cache_slots > 0 ? p.page_size : 1));
  return with_element_type(dtype, false, [&](auto element, auto) {
    using T = decltype(element);
    constexpr int V = 16 / sizeof(T);
    if (p.width == 1) return launch<T, 1, true>(p, ptrs, page_div, stream);
    if (p.is_neox) return launch<T, V, true>(p, ptrs, page_div, stream);
    return launch<T, V, false>(p, ptrs, page_div, stream);
  });
}

}  // namespace attnprep::cuda
