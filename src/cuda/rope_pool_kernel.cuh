// rope_pool_fused's rotation kernel and its configurations: a block per token (or slice) builds the token's cos/sin
// table in shared memory, then its threads walk the token's items (cuda/rope_item.cuh); with an aligned
// cos_sin_cache the common shape reads cos/sin (and weights) from the rows instead, with no barrier.
#pragma once

#include <cstdint>

#include "core/rope_pool.h"
#include "cuda/launch.h"
#include "cuda/rope_item.cuh"

namespace attnprep::cuda::rope {

// Where a block's cos/sin (and, with the QK norm, its weights) come from.
enum class CosSin : int {
  kTable,      // the block's table in shared memory, behind one barrier
  kTableWarp,  // the same, built by an extra warp behind a named barrier
  kRows,       // each item reads the token's cos_sin_cache row and the weights
  kWarpRows,   // each warp copies the row and the 2-byte weights to shared memory
};

// The occupancy target of a configuration (RopeCudaPolicy): the launch bounds'
// blocks per multiprocessor.
constexpr int rope_min_blocks_per_sm(bool norm, bool fp8, int ahead, bool table_warp, bool short_token) {
  if (!norm) return Policy::min_blocks_per_sm;
  if (table_warp)
    return fp8 ? Policy::norm_table_warp_fp8_min_blocks_per_sm : Policy::norm_table_warp_min_blocks_per_sm;
  if (ahead == 0 && !fp8) return Policy::norm_one_round_min_blocks_per_sm;
  if (short_token) return Policy::norm_short_token_min_blocks_per_sm;
  return Policy::norm_min_blocks_per_sm;
}

// One configuration of rope_pool_kernel: its compile-time choices (access width, prefetch, fp8 pools, NormMode,
// the common shape, CosSin source, tail slices, short tokens), from which its launch bounds derive; the shipped
// ones are RopeVariants' members.
template <typename T_, int kWidth, bool kPrefetch, bool kFp8, int kNorm, bool kNeoxFull, CosSin kCosSin,
          bool kTail = false, bool kShortToken = false>
struct RopeConfig {
  using T = T_;
  static constexpr int width = kWidth;
  static constexpr int ahead = kPrefetch ? Policy::prefetch_rounds_ahead : 0;
  static constexpr bool fp8 = kFp8;
  static constexpr int norm = kNorm;
  static constexpr bool neox_full = kNeoxFull;
  static constexpr bool row_cs = kCosSin == CosSin::kRows || kCosSin == CosSin::kWarpRows;
  static constexpr bool warp_rows = kCosSin == CosSin::kWarpRows;
  static constexpr bool table_warp = kCosSin == CosSin::kTableWarp;
  static constexpr bool tail = kTail;
  static constexpr bool short_token = kShortToken;
  static constexpr int threads = Policy::max_threads + (table_warp ? Policy::table_warp_threads : 0);
  static constexpr int min_blocks_per_sm = rope_min_blocks_per_sm(norm != kNoNorm, fp8, ahead, table_warp, short_token);

  static_assert(!kPrefetch || Policy::prefetch_rounds_ahead > 0, "several-round blocks prefetch");
  static_assert(!row_cs || (kNeoxFull && kWidth > 1), "rows are read for the common shape only");
  static_assert(!warp_rows || norm != kNoNorm, "warp rows are for QK-norm blocks");
  static_assert(!kTail || (kPrefetch && norm != kNoNorm && !kFp8), "tails are for several-round norm blocks");
  static_assert(!table_warp || (!kPrefetch && norm != kNoNorm), "table warps are for one-round norm blocks");
};

// The configurations a launcher picks from (cuda/rope_pool_launch.cuh). 8 of 204 spill on sm_90, each a measured
// larger occupancy target: Gemma's weights in one-round and short-token blocks (8-38 B), Llama's short-token tail on
// warp rows (4 B): the extra block gained more than the spills cost.
template <typename T, bool kFp8, bool kNeoxFull, bool kRowCs>
struct RopeVariants {
  static constexpr int V = 16 / sizeof(T);
  static constexpr CosSin kSource = kRowCs ? CosSin::kRows : CosSin::kTable;
  // several-round norm blocks on the row path copy the rows per warp
  static constexpr CosSin kStaged = kRowCs ? CosSin::kWarpRows : CosSin::kTable;
  // RoPE alone
  using Scalar = RopeConfig<T, 1, false, kFp8, kNoNorm, false, CosSin::kTable>;
  using OneRound = RopeConfig<T, V, false, kFp8, kNoNorm, kNeoxFull, kSource>;
  using SeveralRounds = RopeConfig<T, V, true, kFp8, kNoNorm, kNeoxFull, kSource>;
  // with the QK norm, kNorm a NormMode
  template <int kNorm>
  using NormOneRound = RopeConfig<T, V, false, kFp8, kNorm, kNeoxFull, kSource>;
  template <int kNorm>
  using NormOneRoundStaged = RopeConfig<T, V, false, kFp8, kNorm, kNeoxFull, CosSin::kWarpRows>;
  template <int kNorm>
  using NormOneRoundTableWarp = RopeConfig<T, V, false, kFp8, kNorm, kNeoxFull, CosSin::kTableWarp>;
  template <int kNorm>
  using NormSeveralRounds = RopeConfig<T, V, true, kFp8, kNorm, kNeoxFull, kStaged>;
  template <int kNorm>
  using NormSeveralRoundsTail = RopeConfig<T, V, true, false, kNorm, kNeoxFull, kStaged, true>;
  template <int kNorm>
  using NormShortTokens = RopeConfig<T, V, true, false, kNorm, kNeoxFull, kStaged, false, true>;
  template <int kNorm>
  using NormShortTokensTail = RopeConfig<T, V, true, false, kNorm, kNeoxFull, kStaged, true, true>;
};

// The named barrier of a table-warp block (0 is __syncthreads'): the table warp arrives once the table and its
// weights are in shared memory; item warps store their staged weights and wait there before reading them.
constexpr int kTableBarrier = 1;
// The inverse frequencies each table-warp lane parks before the PDL wait
// (lane l: l, l + 32, ...): all of rotary_dim 128's; larger tables read the
// rest after the wait.
constexpr int kTableWarpParked = 2;
// A table-warp block's item threads (those before the table warp).
__device__ __forceinline__ int item_threads() { return static_cast<int>(blockDim.x) - Policy::table_warp_threads; }
__device__ __forceinline__ void table_done() {
  asm volatile("bar.arrive %0, %1;" ::"n"(kTableBarrier), "r"(blockDim.x) : "memory");
}
__device__ __forceinline__ void wait_for_table() {
  asm volatile("bar.sync %0, %1;" ::"n"(kTableBarrier), "r"(blockDim.x) : "memory");
}

// Block (t, s): token t, its (gridDim.y - 1 - s)-th slice of items, as configuration C says. Pointers and the index
// plan come first and the parameter block (with its 1 KB inv_freq table) last, so every block's fields share the
// first lines of the cold parameter bank.
template <typename C>
__global__ void __launch_bounds__(C::threads, C::min_blocks_per_sm)
    rope_pool_kernel(const RopePoolPointers ptr, const core::RopeCudaIndex ix,
                     const __grid_constant__ RopePoolParams p) {
  using T = typename C::T;
  constexpr int W = C::width;
  constexpr int kAhead = C::ahead;
  constexpr bool kFp8 = C::fp8;
  constexpr int kNorm = C::norm;
  constexpr bool kNeoxFull = C::neox_full;
  constexpr bool kRowCs = C::row_cs;
  constexpr bool kWarpRows = C::warp_rows;
  constexpr bool kTail = C::tail;
  constexpr bool kTableWarp = C::table_warp;
  __shared__ __align__(16) float cs[kRowCs ? 1 : 2 * kTableSin];  // cosines, then sines (table_cos_sin)
  __shared__ __align__(16) float norm_w[kNorm != kNoNorm && !kRowCs ? 2 * kNormWeightsK : 4];
  // kWarpRows: the warps' rows, WarpRows::bytes() each (the launcher's
  // dynamic shared memory).
  extern __shared__ uint4 warp_rows_area[];
  const WarpRows rows(p);
  uint4* const area = warp_rows_area + (kWarpRows ? (threadIdx.x / 32) * rows.chunks() : 0);
  const int lane32 = static_cast<int>(threadIdx.x) & 31;
  int64_t t = blockIdx.x;
  const int half = p.rotary_dim / 2;

  // Parameter arithmetic only up to the wait, so with PDL it (the cold parameter-bank reads, the first item's
  // divisions) overlaps the kernel before; 32-bit item arithmetic (bounded by core and the launcher): 64-bit divisions
  // would sit between the launch and the first load.
  const int n_qk = (p.num_qo_heads + p.num_kv_heads) * p.qk_items_per_head;
  const int n_all = n_qk + p.num_kv_heads * p.v_items_per_head;
  const int lanes = p.qk_items_per_head;            // kNorm: a power of two, at most 32
  const float inv_head_dim = inv_pow2(p.head_dim);  // kNorm: a power of two
  // Slices in reverse: a split token's last slice (its k and v heads: the
  // pool writes, with fp8 pools all of the conversion) is its longest, and
  // blocks start in blockIdx order, so it goes first.
  int begin = static_cast<int>(gridDim.y - 1 - blockIdx.y) * ix.items_per_block;
  int share = ix.items_per_block;
  if constexpr (kTail) {
    if (blockIdx.x >= ix.whole_tokens) {
      const core::RopeTailSlice tail = core::rope_tail_slice(ix, blockIdx.x);
      t = tail.token;
      begin = tail.begin;
      share = tail.share;
    }
  }
  const int end = min(n_all, begin + share);
  // One item in flight per thread (two need more registers than the occupancy target allows), its loads issued
  // early so that their round trip overlaps the table and the position's: before the position's checks for RoPE
  // alone into pools of q's dtype, after them elsewhere (no faster there; fp8 pools replayed slower).
  Item<T, W, kNeoxFull> it;
  constexpr bool kEvictLast = kAhead > 0 && Policy::several_round_loads_evict_last;
  constexpr bool kDataFirst = kNorm == kNoNorm && !kFp8;
  // kTableWarp: the last warp computes the table and has no item.
  const bool table_warp = kTableWarp && threadIdx.x >= blockDim.x - Policy::table_warp_threads;
  int item = table_warp ? end : begin + static_cast<int>(threadIdx.x);
  if (item < end) it.locate(p, ptr, ix, t, item, n_qk);
  // kWarpRows: the warps that rotate (in one-round blocks, those with a q or
  // k item) copy the rows, and the weights their items multiply as pairs.
  bool warp_rows = false;
  if constexpr (kWarpRows) warp_rows = kAhead == 0 ? __any_sync(0xffffffffu, item < end && !it.is_v) : begin < n_qk;
  const bool copy_q = paired_weights<T, kNorm>(p, false), copy_k = paired_weights<T, kNorm>(p, true);
  // The table path with 2-byte Llama/Qwen3-rounded weights on 16 bytes: they are copied asynchronously into norm_w
  // before the position is read, so their round trip overlaps the position's instead of following its checks.
  bool async_w = false;
  if constexpr (kNorm != kNoNorm && !kRowCs && kNeoxFull) {
    async_w = (copy_q || copy_k) && (copy_q || !p.norm_q) && (copy_k || !p.norm_k) &&
              (!copy_q || on16(ptr.q_norm_weight)) && (!copy_k || on16(ptr.k_norm_weight));
  }
  // The table threads' first inverse frequencies, parked in shared memory before the wait: a parameter read sinks
  // below griddepcontrol.wait and would stand between the wait and the table; parked, it overlaps the kernel
  // before. Read through the block's generic address: one load per warp.
  if constexpr (kTableWarp) {
    if (table_warp && !p.use_cache)
#pragma unroll
      for (int j = 0; j < kTableWarpParked; ++j)
        if (lane32 + 32 * j < half) cs[lane32 + 32 * j] = read_param_float(p.inv_freq + lane32 + 32 * j);
  } else if constexpr (!kRowCs) {
    if (!p.use_cache && static_cast<int>(threadIdx.x) < half)
      cs[threadIdx.x] = read_param_float(p.inv_freq + threadIdx.x);
  }

  wait_for_prior_kernels();  // cuda/launch.h: before any global memory access
  // Not at entry, as the copy engine does: the next call's blocks would then
  // take multiprocessor slots this kernel's later tokens still need.
  let_next_kernel_start();
  if constexpr (kNorm != kNoNorm && !kRowCs && kNeoxFull) {
    if (async_w) {
      const int chunks = p.head_dim * 2 / 16;  // one tensor's weights, 16 bytes a chunk
      // (kTableWarp: the table warp's lanes alone)
      const int c_first = kTableWarp ? lane32 : static_cast<int>(threadIdx.x);
      const int c_step = kTableWarp ? 32 : static_cast<int>(blockDim.x);
      for (int c = c_first; (!kTableWarp || table_warp) && c < 2 * chunks; c += c_step) {
        const bool k = c >= chunks;
        const int j = k ? c - chunks : c;  // the chunk within its tensor
        if (k ? copy_k : copy_q)
          copy_async(reinterpret_cast<uint4*>(norm_w + (k ? kNormWeightsK : 0)) + j,
                     static_cast<const uint4*>(k ? ptr.k_norm_weight : ptr.q_norm_weight) + j, 16);
      }
      commit_async_copies();
    }
  }
  if constexpr (kDataFirst)
    if (item < end) it.template load<kEvictLast>();
  TokenPlace place = read_token_place(p, ptr, t);
  // kWarpRows: the item's loads and the weights' copies issued while the
  // position travels, not after its checks.
  if constexpr (kWarpRows) {
    if (item < end) it.template load<kEvictLast>();
    if (warp_rows) copy_warp_weights(ptr, rows, area, copy_q, copy_k, lane32);
  }
  place = check_token_place(p, place);
  const int64_t pos = place.pos, slot = place.slot;
  const bool pos_ok = place.pos_ok, write_pool = place.write_pool;
  float scale = 1.f;
  if (item < end) {
    if constexpr (!kDataFirst && !kWarpRows) it.template load<kEvictLast>();
    scale = it.template pool_scale_of<kFp8>(p, ptr);
    // Blocks of several rounds only: in one-round blocks (small calls) it
    // made graph replay slower, where the rows are in L2 already.
    if constexpr (kRowCs && kAhead > 0 && !kWarpRows)
      if (!it.is_v && pos_ok) prefetch_row_cos_sin(p, ptr, pos, it.freq);
  }
  if constexpr (kWarpRows) {
    if (warp_rows) copy_warp_row(p, ptr, rows, area, pos, pos_ok, lane32);
    commit_async_copies();
  }
#pragma unroll
  for (int r = 1; r <= kAhead; ++r)
    prefetch_item<T, W, kNeoxFull>(p, ptr, ix, t, item + r * static_cast<int>(blockDim.x), end, n_qk);
  // The norm weights, staged around the table (start_norm_weights), by every
  // thread of the block; kTableWarp: by the item threads, each storing its
  // share before it signals or waits at the table barrier.
  NormWeightBits first_w;
  if constexpr (kNorm != kNoNorm && !kRowCs)
    if (!async_w && !table_warp) first_w = start_norm_weights<T>(p, ptr);
  // One table per block: a table per warp repeats the cos/sin work, which costs more than a barrier. kTableWarp: one
  // warp builds it (and copies the 2-byte weights) behind a named barrier, then leaves; staging every weight in
  // that warp alone made a chain of round trips (2.5 us replayed at T = 1).
  if constexpr (kTableWarp) {
    if (table_warp) {
      for (int i = lane32; i < half; i += 32) {
        const float2 r = token_cos_sin(p, ptr.cos_sin_cache, freq_position(p, ptr, t, pos, i), pos_ok, i,
                                       i < 32 * kTableWarpParked ? cs[i] : p.inv_freq[i]);
        cs[i] = r.x;
        cs[kTableSin + i] = r.y;
      }
      if (async_w) wait_async_copies();
      table_done();
      return;
    }
  } else if constexpr (!kRowCs) {
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
      const float2 r = token_cos_sin(p, ptr.cos_sin_cache, freq_position(p, ptr, t, pos, i), pos_ok, i,
                                     i == static_cast<int>(threadIdx.x) ? cs[i] : p.inv_freq[i]);
      cs[i] = r.x;
      cs[kTableSin + i] = r.y;
    }
    if constexpr (kNorm != kNoNorm) {
      if (async_w)
        wait_async_copies();
      else
        finish_norm_weights<T>(norm_w, p, ptr, first_w, kNeoxFull && copy_q, kNeoxFull && copy_k);
    }
    __syncthreads();
  }
  // kTableWarp, an item warp: its share of the staged weights stored, then
  // at the table barrier, waiting (it has an item) or only counted (none).
  const auto table_barrier = [&](bool wait) {
    if (!async_w)
      finish_norm_weights<T>(norm_w, p, ptr, first_w, kNeoxFull && copy_q, kNeoxFull && copy_k,
                             static_cast<int>(threadIdx.x), item_threads());
    if (wait)
      wait_for_table();
    else
      table_done();
  };
  bool table_waited = false;  // kTableWarp: whether this (item) warp has waited for the table
  for (;;) {
    const bool active = item < end;
    float inv = 0.f;
    if constexpr (kNorm != kNoNorm) {
      // the butterfly needs every lane of the warp: the warp stays together
      // until none of its lanes has an item
      if (!__any_sync(0xffffffffu, active)) break;
      inv = it.head_norm_factor(p, lanes, inv_head_dim, active);
      if constexpr (kTableWarp) {
        table_barrier(true);
        table_waited = true;
      }
      if constexpr (kWarpRows)
        if (warp_rows) warp_rows_ready();  // (after the first round: no copies left, a no-op)
      if (active)
        it.template finish<kFp8, kNorm, kRowCs, kWarpRows>(p, ptr, ix, cs, pos, pos_ok, slot, write_pool, norm_w, inv,
                                                           scale, rows, area);
    } else {
      if (!active) break;
      it.template finish<kFp8, kNorm, kRowCs, kWarpRows>(p, ptr, ix, cs, pos, pos_ok, slot, write_pool, norm_w, inv,
                                                         scale, rows, area);
    }
    // One-round blocks have no second item (core::plan_rope_cuda_launch).
    if constexpr ((kWarpRows || kTableWarp) && kAhead == 0) break;
    item += blockDim.x;
    if (item < end) {
      it.locate(p, ptr, ix, t, item, n_qk);
      it.template load<kEvictLast>();
      scale = it.template pool_scale_of<kFp8>(p, ptr);
      if constexpr (kAhead > 0)
        prefetch_item<T, W, kNeoxFull>(p, ptr, ix, t, item + kAhead * static_cast<int>(blockDim.x), end, n_qk);
    }
  }
  if constexpr (kTableWarp)
    if (!table_waited) table_barrier(false);
}

}  // namespace attnprep::cuda::rope
