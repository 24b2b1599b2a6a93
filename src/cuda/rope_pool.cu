// Fused RoPE + KV-pool write. Each block serves one token (or a slice of
// one): it computes the token's cos/sin table (rotary_dim / 2 entries, shared
// by every head) into shared memory, then its threads walk the token's work
// items: rotate each q and k head, store q_rot/k_rot, and scatter the rotated
// k and the raw v into the pools (paged or flat, in q's dtype or fp8) when the
// token's slot is in [0, pool_size). With an aligned cos_sin_cache the common
// shape skips the table: each item reads its cos/sin (and norm weights) from
// their rows, and the block has no barrier (kRowCs); with the QK norm each
// warp copies the row and the weights into shared memory asynchronously,
// early, and its items read them there (kWarpRows).
#include "cuda/rope_pool.h"

#include "core/rope_pool.h"
#include "cuda/launch.h"
#include "cuda/rope_device.cuh"

#include <cstdint>

// Stage timestamps for bench/diagnostics/rope_stamps.cu, which defines this
// before including this file (0: entry, 1 / 2: before / after the PDL wait,
// then around a QK-norm item's norm factor, its warp rows and its finish);
// nothing here.
#ifndef ATTNPREP_ROPE_STAMP
#define ATTNPREP_ROPE_STAMP(point)
#endif

namespace attnprep::cuda {
namespace {

using namespace rope;

using Policy = core::RopeCudaPolicy;
constexpr int kThreads = Policy::max_threads;
// kAhead == 0 marks the instantiations whose blocks serve one round (the
// launcher's choice below), which the launch bounds rely on.
static_assert(Policy::prefetch_rounds_ahead > 0, "several-round blocks must prefetch");

// Whether a pointer starts on 16 bytes (what one vector access of a row or of
// the norm weights needs).
__host__ __device__ __forceinline__ bool on16(const void* a) { return reinterpret_cast<uintptr_t>(a) % 16 == 0; }

// Whether q's (is_k: k's) norm weights are 2-byte and meet the normalized
// values with the Llama/Qwen3 rounding, as one paired multiply in T.
template <typename T, int kNorm>
__device__ __forceinline__ bool paired_weights(const RopePoolParams& p, bool is_k) {
  if constexpr (kNorm == kNormRoundThenWeight && sizeof(T) == 2)
    return is_k ? p.norm_k && !p.k_norm_f32 : p.norm_q && !p.q_norm_f32;
  return false;
}

// One work item: up to two groups of W elements of one head (lo, and hi when
// `two`), where they come from and go to, and which frequencies rotate them.
// kNeoxFull: the common shape, known at compile time (NeoX pairs, the whole
// head rotated, v items two groups half a head apart: core::rope_neox_full):
// q and k items are then always NeoX pairs with an output row, v items two
// groups, and the run-time tests of `kind`, `two` and `dst` go away.
template <typename T, int W, bool kNeoxFull = false>
struct Item {
  enum Kind { kNeox, kGptj, kCopy };
  Kind kind = kCopy;
  bool is_q = false, is_v = false, two = false;
  int head = 0;
  const T* src = nullptr;
  T* dst = nullptr;   // q_rot/k_rot; null for v and for in-place pass-through
  int lo_off = 0, hi_off = 0, freq = 0;
  Group<T, W> lo, hi;
  // kRowCs with the QK norm: the item's 2-byte weights (pair_weights)
  Group<T, W> w_lo, w_hi;

  // q or k head `qk_head` of token t (q heads first): the head within q or
  // k, and where its items read and write.
  __device__ __forceinline__ void point_qk(const RopePoolParams& p, const RopePoolPointers& ptr, int64_t t,
                                           int qk_head) {
    is_q = qk_head < p.num_qo_heads;
    if (is_q) {
      head = qk_head;
      src = static_cast<const T*>(ptr.q) + t * p.q_stride_token + head * p.q_stride_head;
      dst = static_cast<T*>(ptr.q_rot) + t * p.qo_stride_token + head * p.qo_stride_head;
    } else {
      head = qk_head - p.num_qo_heads;
      src = static_cast<const T*>(ptr.k) + t * p.k_stride_token + head * p.k_stride_head;
      dst = static_cast<T*>(ptr.k_rot) + t * p.ko_stride_token + head * p.ko_stride_head;
    }
  }

  // Where item `item` of token t lives. Nothing here waits for the token's
  // position or slot, so the loads that follow overlap that round trip.
  // Item indices are 32-bit: the launcher refuses tokens of 2^30 items.
  __device__ __forceinline__ void locate(const RopePoolParams& p, const RopePoolPointers& ptr,
                                         const core::RopeCudaIndex& ix, int64_t t, int item, int n_qk) {
    constexpr int F = W == 1 ? 1 : W / 2;
    const int half = p.rotary_dim / 2;
    if constexpr (kNeoxFull) {
      is_v = item >= n_qk;
      if (is_v) {
        const int r = item - n_qk;
        head = static_cast<int>(ix.v_items.div(static_cast<uint32_t>(r)));
        lo_off = (r - head * p.v_items_per_head) * W;
        hi_off = lo_off + p.v_items_per_head * W;
        is_q = false;
        src = static_cast<const T*>(ptr.v) + t * p.v_stride_token + head * p.v_stride_head;
        return;
      }
      const int qk_head = static_cast<int>(ix.qk_items.div(static_cast<uint32_t>(item)));
      freq = (item - qk_head * p.qk_items_per_head) * W;
      lo_off = freq;
      hi_off = half + freq;
      point_qk(p, ptr, t, qk_head);
      return;
    }
    // A thread reuses one Item for all its items: reset what a branch below
    // may leave unset.
    is_q = false;
    is_v = false;
    two = false;
    dst = nullptr;
    if (item >= n_qk) {  // v: copied into the pool only
      const int r = item - n_qk;
      head = static_cast<int>(ix.v_items.div(static_cast<uint32_t>(r)));
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
    const int qk_head = static_cast<int>(ix.qk_items.div(static_cast<uint32_t>(item)));
    const int sub = item - qk_head * qk;
    point_qk(p, ptr, t, qk_head);
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

  // What locate decided, at compile time where kNeoxFull knows it.
  __device__ __forceinline__ bool has_hi() const { return kNeoxFull || two; }
  __device__ __forceinline__ bool neox() const { return kNeoxFull ? !is_v : kind == kNeox; }
  __device__ __forceinline__ bool gptj() const { return !kNeoxFull && kind == kGptj; }
  __device__ __forceinline__ bool has_dst() const { return kNeoxFull ? !is_v : dst != nullptr; }

  template <bool kEvictLast = false>
  __device__ __forceinline__ void load() {
    lo.template load<kEvictLast>(src + lo_off);
    if (has_hi()) hi.template load<kEvictLast>(src + hi_off);
  }
  // Whether finish normalizes this item with 2-byte weights and the
  // Llama/Qwen3 rounding as one paired multiply (kRowCs only).
  template <int kNorm>
  __device__ __forceinline__ bool pair_weights(const RopePoolParams& p) const {
    return !is_v && paired_weights<T, kNorm>(p, !is_q);
  }
  // Those weights into w_lo / w_hi, from their tensors (one-round blocks
  // past the warp rows' limit, RopeCudaPolicy::norm_stage_max_blocks_per_sm).
  template <int kNorm>
  __device__ __forceinline__ void load_weights(const RopePoolParams& p, const RopePoolPointers& ptr) {
    if (!pair_weights<kNorm>(p)) return;
    const T* wt = static_cast<const T*>(is_q ? ptr.q_norm_weight : ptr.k_norm_weight);
    w_lo.load(wt + lo_off);
    w_hi.load(wt + hi_off);
  }
  // The item's 2-byte weights from one tensor's copy in shared memory, in T
  // (the warp rows, or the block's staged raw sections), into w_lo / w_hi.
  __device__ __forceinline__ void read_t_weights(const T* wt) {
    *reinterpret_cast<uint4*>(w_lo.e) = *reinterpret_cast<const uint4*>(wt + lo_off);
    *reinterpret_cast<uint4*>(w_hi.e) = *reinterpret_cast<const uint4*>(wt + hi_off);
  }
  // fp8 pools: the dequantization scale of the item's pool row, read right
  // after its loads so that the round trip overlaps theirs (read where the
  // row is written, it would add a second round trip before every store).
  template <bool kFp8>
  __device__ __forceinline__ float pool_scale_of(const RopePoolParams& p, const RopePoolPointers& ptr) const {
    if constexpr (kFp8) return is_q ? 1.f : pool_scale(p, ptr, head, is_v);
    return 1.f;
  }
  // Asks L2 for the item's lines now, to be evicted last (as load()'s
  // kEvictLast); a later load() then hits L2.
  __device__ __forceinline__ void prefetch() const {
    prefetch_l2<Policy::several_round_loads_evict_last>(src + lo_off);
    if (has_hi()) prefetch_l2<Policy::several_round_loads_evict_last>(src + hi_off);
  }
  // kNorm: 1/sqrt(mean square + eps) of this item's head. The item's groups
  // are whole blocks of the pairwise sum (core::rope_norm_in_rotation_kernel):
  // each group's squares, then a butterfly over the head's `lanes` lanes
  // (NeoX: the two halves apart, as the tree keeps them), then the root.
  // Every lane of the warp calls it; `active` false contributes nothing.
  // inv_head_dim: 1 / head_dim, exact (head_dim is a power of two here).
  __device__ __forceinline__ float head_norm_factor(const RopePoolParams& p, int lanes, float inv_head_dim,
                                                    bool active) const {
    float lo_sum = active ? group_squares(lo) : 0.f;
    float hi_sum = active && neox() ? group_squares(hi) : 0.f;
    for (int off = 1; off < lanes; off *= 2) {
      lo_sum = __fadd_rn(lo_sum, __shfl_xor_sync(0xffffffffu, lo_sum, off));
      hi_sum = __fadd_rn(hi_sum, __shfl_xor_sync(0xffffffffu, hi_sum, off));
    }
    return norm_factor_pow2(__fadd_rn(lo_sum, hi_sum), inv_head_dim, p);
  }

  // kFp8: the pools are float8 (stored x / scale, `scale` read by
  // pool_scale_of with the item's loads); otherwise T. kNorm (a NormMode):
  // q and k groups are normalized first (weights `w` in shared memory, the
  // head's factor `inv`). kRowCs (kNeoxFull only): cos/sin straight from the
  // token's cos_sin_cache row (row_cos_sin), else from the block's table
  // `cs`; kWarpRows: the 2-byte weights and the cos/sin from the warp's
  // rows in shared memory (`rows` at `area`) instead. Groups of W > 1
  // elements (W even) compute on pairs (Group::get2/set2).
  template <bool kFp8, int kNorm, bool kRowCs, bool kWarpRows>
  __device__ __forceinline__ void finish(const RopePoolParams& p, const RopePoolPointers& ptr,
                                         const core::RopeCudaIndex& ix, const float* cs, int64_t pos, bool pos_ok,
                                         int64_t slot, bool write_pool, const float* w, float inv, float scale,
                                         const WarpRows& rows, const uint4* area) {
    static_assert(!kRowCs || (kNeoxFull && W > 1), "rows are read for the common shape only");
    if constexpr (kNorm != kNoNorm) {
      if (!is_v && (is_q ? p.norm_q : p.norm_k)) {
        if (kNeoxFull && pair_weights<kNorm>(p)) {
          // 2-byte weights with the Llama/Qwen3 rounding: one paired multiply
          if constexpr (kWarpRows)
            read_t_weights(reinterpret_cast<const T*>(area + rows.row_chunks + (is_q ? 0 : rows.weight_chunks)));
          else if constexpr (kRowCs)  // straight from their tensor, as the cos/sin
            load_weights<kNorm>(p, ptr);
          else  // staged in T (finish_norm_weights' raw sections)
            read_t_weights(reinterpret_cast<const T*>(w + (is_q ? 0 : kNormWeightsK)));
          if constexpr (kNorm == kNormRoundThenWeight && sizeof(T) == 2) {
            normalize_round_then_t_weight(lo, w_lo, inv);
            normalize_round_then_t_weight(hi, w_hi, inv);
          }
        } else if constexpr (kRowCs) {
          float wv[W];
          row_norm_weights<kNorm, T>(p, ptr, !is_q, lo_off, wv);
          normalize_with<kNorm>(lo, [&](int i) { return wv[i]; }, inv);
          row_norm_weights<kNorm, T>(p, ptr, !is_q, hi_off, wv);
          normalize_with<kNorm>(hi, [&](int i) { return wv[i]; }, inv);
        } else {
          const float* wh = w + (is_q ? 0 : kNormWeightsK);
          normalize_group<kNorm>(lo, wh + lo_off, inv);
          if (has_hi()) normalize_group<kNorm>(hi, wh + hi_off, inv);
        }
      }
    }
    if (neox()) {
      if constexpr (W == 1) {
        rotate(lo.e[0], hi.e[0], table_cos_sin(cs, freq));
      } else {
        // (cos, sin) of frequencies freq ... freq + W - 1, read at once in the
        // common shape; elsewhere pair by pair from the table (fewer live
        // registers: read at once, the norm instantiations spilled)
        float2 row[kNeoxFull ? W : 1];
        if constexpr (kWarpRows) {
          cos_sin_at<W, false>(p, reinterpret_cast<const char*>(area) + freq * (p.cache_bf16 ? 2 : 4), row);
        } else if constexpr (kRowCs) {
          row_cos_sin<W>(p, ptr, pos, pos_ok, freq, row);
        } else if constexpr (kNeoxFull) {
          table_cos_sin<W>(cs, freq, row);
        }
        const auto at = [&](int i) {
          if constexpr (kNeoxFull) return row[i];
          else return table_cos_sin(cs, freq + i);
        };
#pragma unroll
        for (int j = 0; j < W / 2; ++j) {
          const float2 a = lo.get2(j), b = hi.get2(j);
          const float2 r0 = at(2 * j), r1 = at(2 * j + 1);
          lo.set2(j, rotate_first(a.x, b.x, r0), rotate_first(a.y, b.y, r1));
          hi.set2(j, rotate_second(a.x, b.x, r0), rotate_second(a.y, b.y, r1));
        }
      }
    } else if (gptj()) {
      if constexpr (W == 1) {
        rotate(lo.e[0], hi.e[0], table_cos_sin(cs, freq));
      } else {
#pragma unroll
        for (int j = 0; j < W / 2; ++j) {
          const float2 x = lo.get2(j), r = table_cos_sin(cs, freq + j);
          lo.set2(j, rotate_first(x.x, x.y, r), rotate_second(x.x, x.y, r));
        }
      }
    }
    if (has_dst()) {
      lo.store(dst + lo_off);
      if (has_hi()) hi.store(dst + hi_off);
    }
    if (write_pool && !is_q) {
      const int64_t row = pool_row(p, ix.page, slot, head, is_v);
      if constexpr (!kFp8) {
        T* pool = static_cast<T*>(is_v ? ptr.v_pool : ptr.k_pool) + row;
        lo.store(pool + lo_off);
        if (has_hi()) hi.store(pool + hi_off);
      } else {
        unsigned char* pool = static_cast<unsigned char*>(is_v ? ptr.v_pool : ptr.k_pool) + row;
        const core::Fp8Quotient quotient(scale);
        store_fp8(lo, pool + lo_off, quotient, p.pool_fp8);
        if (has_hi()) store_fp8(hi, pool + hi_off, quotient, p.pool_fp8);
      }
    }
  }

  // (a, b) -> (a cos - b sin, b cos + a sin) in float32, one rounding to T each.
  static __device__ __forceinline__ void rotate(T& a, T& b, float2 r) {
    const float x = to_float(a), y = to_float(b);
    a = from_float<T>(rotate_first(x, y, r));
    b = from_float<T>(rotate_second(x, y, r));
  }
};

// Asks L2 for item `item` of token t (when the block has it).
template <typename T, int W, bool kNeoxFull>
__device__ __forceinline__ void prefetch_item(const RopePoolParams& p, const RopePoolPointers& ptr,
                                              const core::RopeCudaIndex& ix, int64_t t, int item, int end, int n_qk) {
  if (item < end) {
    Item<T, W, kNeoxFull> ahead;
    ahead.locate(p, ptr, ix, t, item, n_qk);
    ahead.prefetch();
  }
}

// The named barrier (0 is __syncthreads') of a table-warp block: the table
// warp arrives once the table and the weights it copies are in shared
// memory, each item warp stores its share of the staged weights and waits
// there before it reads them; all the block's threads count.
constexpr int kTableBarrier = 1;
// The inverse frequencies each table-warp lane parks before the PDL wait
// (lane l: l, l + 32, ...): all of rotary_dim 128's; larger tables read the
// rest after the wait.
constexpr int kTableWarpParked = 2;
// A table-warp block's item threads (those before the table warp).
__device__ __forceinline__ int item_threads() {
  return static_cast<int>(blockDim.x) - Policy::table_warp_threads;
}
__device__ __forceinline__ void table_done() {
  asm volatile("bar.arrive %0, %1;" ::"n"(kTableBarrier), "r"(blockDim.x) : "memory");
}
__device__ __forceinline__ void wait_for_table() {
  asm volatile("bar.sync %0, %1;" ::"n"(kTableBarrier), "r"(blockDim.x) : "memory");
}

// Block (t, s): token t, the (gridDim.y - 1 - s)-th of gridDim.y slices of
// its work items.
// kAhead: while on an item, ask L2 for the one kAhead rounds later (0: the
// blocks serve one round, core::RopeCudaPolicy's one-round bounds). kFp8: the
// pools are float8 (a separate instantiation: the conversion's registers would
// make the common case spill under the occupancy target). kNorm (a NormMode):
// the QK norm too, where core::rope_norm_in_rotation_kernel allows it (slices
// then start on head boundaries, so a head's items are lanes of one warp in
// one round). kRowCs (kNeoxFull, cos_sin_cache given with p.cache_vector,
// norm weights 16-byte aligned): no block set-up; each item reads its
// cos/sin from the token's row and its norm weights from their tensors, and
// the block has no barrier. kWarpRows (kRowCs, the QK norm): each warp's
// copy of the token's cos/sin row and of the 2-byte weights in dynamic shared
// memory (WarpRows), copied asynchronously as soon as their addresses are
// known, read by the warp's items. The parameters: pointers and index plan first,
// the parameter block with its 1 KB inv_freq table last, so that the fields
// every block reads share the first cache lines of the parameter bank, which
// is cold at each launch. kTail (several rounds, the QK norm, pools in q's
// dtype; core::plan_rope_cuda_tail): blocks from ix.whole_tokens on serve
// the call's last tokens in one-round slices. kShortToken (several rounds,
// the QK norm, pools in q's dtype, tokens of at most
// RopeCudaPolicy::norm_short_token_max_rounds rounds): the launch bounds ask
// for norm_short_token_min_blocks_per_sm instead of norm_min_blocks_per_sm.
template <typename T, int W, int kAhead, bool kFp8, int kNorm, bool kNeoxFull, bool kRowCs, bool kWarpRows = false,
          bool kTail = false, bool kShortToken = false, bool kTableWarp = false>
__global__ void __launch_bounds__(kTableWarp ? kThreads + Policy::table_warp_threads : kThreads,
                                  kNorm == kNoNorm ? Policy::min_blocks_per_sm
                                  : kTableWarp     ? (kFp8 ? Policy::norm_table_warp_fp8_min_blocks_per_sm
                                                           : Policy::norm_table_warp_min_blocks_per_sm)
                                  : kAhead == 0 && !kFp8 ? Policy::norm_one_round_min_blocks_per_sm
                                  : kShortToken          ? Policy::norm_short_token_min_blocks_per_sm
                                                         : Policy::norm_min_blocks_per_sm)
    rope_pool_kernel(const RopePoolPointers ptr, const core::RopeCudaIndex ix,
                     const __grid_constant__ RopePoolParams p) {
  __shared__ __align__(16) float cs[kRowCs ? 1 : 2 * kTableSin];  // cosines, then sines (table_cos_sin)
  __shared__ __align__(16) float norm_w[kNorm != kNoNorm && !kRowCs ? 2 * kNormWeightsK : 4];
  // kWarpRows: the warps' rows, WarpRows::bytes() each (the launcher's
  // dynamic shared memory).
  static_assert(!kWarpRows || (kRowCs && kNorm != kNoNorm), "warp rows are for norm row blocks");
  static_assert(!kTail || (kAhead > 0 && kNorm != kNoNorm && !kFp8), "tails are for several-round norm blocks");
  static_assert(!kTableWarp || (kAhead == 0 && kNorm != kNoNorm && !kRowCs), "table warps are for one-round norm table blocks");
  ATTNPREP_ROPE_STAMP(0);
  extern __shared__ uint4 warp_rows_area[];
  const WarpRows rows(p);
  uint4* const area = warp_rows_area + (kWarpRows ? (threadIdx.x / 32) * rows.chunks() : 0);
  const int lane32 = static_cast<int>(threadIdx.x) & 31;
  int64_t t = blockIdx.x;
  const int half = p.rotary_dim / 2;

  // Parameter arithmetic only up to the wait: with PDL it overlaps the kernel
  // before this one, and it includes the first reads of the parameter bank
  // (cold at each launch) and the divisions that place the first item.
  // Item arithmetic is 32-bit (core bounds the heads, the launcher the
  // items): 64-bit divisions here sit between the launch and the first load.
  const int n_qk = (p.num_qo_heads + p.num_kv_heads) * p.qk_items_per_head;
  const int n_all = n_qk + p.num_kv_heads * p.v_items_per_head;
  const int lanes = p.qk_items_per_head;  // kNorm: a power of two, at most 32
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
  // One item in flight per thread, its loads issued before the cos/sin table
  // so they overlap that work. For RoPE alone into pools of q's dtype they
  // also come before the token's position and slot are read: check_token_place's
  // checks use the position at once, and loads placed after it were issued
  // only once it had arrived, so the data's first round trip followed the
  // position's instead of overlapping it. With the warp rows (kWarpRows)
  // they come right after the position's and slot's loads and before their
  // checks. Elsewhere (RoPE alone into fp8 pools, the QK norm off the row
  // path) they follow the checks in the source: there the earlier start did
  // not shorten the call, and fp8 pools replayed slower
  // (docs/performance-notes.md). (With the QK norm on the table path ptxas
  // issues them right after the position's loads, or before them in
  // one-round blocks, anyway: nothing they need waits for the checks.)
  // (Two items in flight need more registers than the occupancy target
  // allows.)
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
  // The table path (kNeoxFull), every normed side's weights 2-byte with the
  // Llama/Qwen3 rounding and on 16 bytes: they are copied asynchronously
  // into norm_w's raw sections (the image finish_norm_weights would store)
  // before the position is read, so their round trip overlaps the
  // position's instead of following its checks.
  bool async_w = false;
  if constexpr (kNorm != kNoNorm && !kRowCs && kNeoxFull) {
    async_w = (copy_q || copy_k) && (copy_q || !p.norm_q) && (copy_k || !p.norm_k) &&
              (!copy_q || on16(ptr.q_norm_weight)) && (!copy_k || on16(ptr.k_norm_weight));
  }
  // The table's threads' first inverse frequencies (kTableWarp: the table
  // warp's, kTableWarpParked per lane), each parked in its own table entry
  // before the wait: ptxas sinks a parameter read below
  // griddepcontrol.wait, and this one (cold at each launch) then stood
  // between the wait and the table; a shared-memory store keeps it above the
  // wait, where it overlaps the kernel before. Read through the block's
  // generic address (read_param_float): one load per warp, not 32
  // parameter-bank reads.
  if constexpr (kTableWarp) {
    if (table_warp && !p.use_cache)
#pragma unroll
      for (int j = 0; j < kTableWarpParked; ++j)
        if (lane32 + 32 * j < half) cs[lane32 + 32 * j] = read_param_float(p.inv_freq + lane32 + 32 * j);
  } else if constexpr (!kRowCs) {
    if (!p.use_cache && static_cast<int>(threadIdx.x) < half)
      cs[threadIdx.x] = read_param_float(p.inv_freq + threadIdx.x);
  }

  ATTNPREP_ROPE_STAMP(1);
  wait_for_prior_kernels();  // cuda/launch.h: before any global memory access
  ATTNPREP_ROPE_STAMP(2);
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
  for (int r = 1; r <= kAhead; ++r) prefetch_item<T, W, kNeoxFull>(p, ptr, ix, t, item + r * static_cast<int>(blockDim.x), end, n_qk);
  // The norm weights, staged around the table (start_norm_weights), by every
  // thread of the block; kTableWarp: by the item threads, each storing its
  // share before it signals or waits at the table barrier.
  NormWeightBits first_w;
  if constexpr (kNorm != kNoNorm && !kRowCs)
    if (!async_w && !table_warp) first_w = start_norm_weights<T>(p, ptr);
  // One table per block: a table per warp would repeat the cos/sin work,
  // which costs more than a barrier. kTableWarp: the table warp's (and the
  // 2-byte weights' asynchronous copies), behind the named barrier that the
  // item warps wait at after their norm; it then leaves. (Staging all the
  // weights in that warp alone made Gemma's weights a chain of round trips:
  // 2.5 us replayed at T = 1.)
  if constexpr (kTableWarp) {
    if (table_warp) {
      for (int i = lane32; i < half; i += 32) {
        const float2 r = token_cos_sin(p, ptr, pos, pos_ok, i, i < 32 * kTableWarpParked ? cs[i] : p.inv_freq[i]);
        cs[i] = r.x;
        cs[kTableSin + i] = r.y;
      }
      if (async_w) wait_async_copies();
      table_done();
      return;
    }
  } else if constexpr (!kRowCs) {
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
      const float2 r = token_cos_sin(p, ptr, pos, pos_ok, i, i == static_cast<int>(threadIdx.x) ? cs[i] : p.inv_freq[i]);
      cs[i] = r.x;
      cs[kTableSin + i] = r.y;
    }
    if constexpr (kNorm != kNoNorm) {
      if (async_w) wait_async_copies();
      else finish_norm_weights<T>(norm_w, p, ptr, first_w, kNeoxFull && copy_q, kNeoxFull && copy_k);
    }
    __syncthreads();
  }
  // kTableWarp, an item warp: its share of the staged weights stored, then
  // at the table barrier, waiting (it has an item) or only counted (none).
  const auto table_barrier = [&](bool wait) {
    if (!async_w)
      finish_norm_weights<T>(norm_w, p, ptr, first_w, kNeoxFull && copy_q, kNeoxFull && copy_k,
                             static_cast<int>(threadIdx.x), item_threads());
    if (wait) wait_for_table();
    else table_done();
  };
  bool table_waited = false;  // kTableWarp: whether this (item) warp has waited for the table
  for (;;) {
    const bool active = item < end;
    float inv = 0.f;
    if constexpr (kNorm != kNoNorm) {
      // the butterfly needs every lane of the warp: the warp stays together
      // until none of its lanes has an item
      if (!__any_sync(0xffffffffu, active)) break;
      ATTNPREP_ROPE_STAMP(3);
      inv = it.head_norm_factor(p, lanes, inv_head_dim, active);
      if constexpr (kTableWarp) {
        table_barrier(true);
        table_waited = true;
      }
      ATTNPREP_ROPE_STAMP(4);
      if constexpr (kWarpRows)
        if (warp_rows) warp_rows_ready();  // (after the first round: no copies left, a no-op)
      ATTNPREP_ROPE_STAMP(5);
      if (active) it.template finish<kFp8, kNorm, kRowCs, kWarpRows>(p, ptr, ix, cs, pos, pos_ok, slot, write_pool, norm_w, inv, scale, rows, area);
      ATTNPREP_ROPE_STAMP(6);
    } else {
      if (!active) break;
      it.template finish<kFp8, kNorm, kRowCs, kWarpRows>(p, ptr, ix, cs, pos, pos_ok, slot, write_pool, norm_w, inv, scale, rows, area);
    }
    // One-round blocks have no second item (core::plan_rope_cuda_launch).
    if constexpr ((kWarpRows || kTableWarp) && kAhead == 0) break;
    item += blockDim.x;
    if (item < end) {
      it.locate(p, ptr, ix, t, item, n_qk);
      it.template load<kEvictLast>();
      scale = it.template pool_scale_of<kFp8>(p, ptr);
      if constexpr (kAhead > 0) prefetch_item<T, W, kNeoxFull>(p, ptr, ix, t, item + kAhead * static_cast<int>(blockDim.x), end, n_qk);
    }
  }
  if constexpr (kTableWarp)
    if (!table_waited) table_barrier(false);
}

template <typename T, bool kFp8, bool kNeoxFull, bool kRowCs>
cudaError_t launch_shape(const RopePoolParams& p, const RopePoolPointers& ptrs, cudaStream_t stream) {
  const bool norm = p.norm_q || p.norm_k;
  const core::RopeCudaLaunch shape = core::plan_rope_cuda_launch(core::rope_items_per_token(p), p.num_tokens);
  dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(shape.splits));
  const dim3 block(shape.threads);
  constexpr int V = 16 / sizeof(T);
  constexpr int kAhead = Policy::prefetch_rounds_ahead;
  constexpr bool kF = kNeoxFull, kR = kRowCs;
  core::RopeCudaIndex ix = core::plan_rope_cuda_index(p, shape.splits, norm ? p.qk_items_per_head : 1);
  if (norm) {  // only where core::rope_norm_in_rotation_kernel (so p.width == V)
    constexpr int kRound = kNormRoundThenWeight, kOffset = kNormOffsetWeight;
    const bool round_first = norm_mode(p) == kNormRoundThenWeight;
    // The row path's warp rows (blocks of several rounds always, one-round
    // blocks in small calls): dynamic shared memory for the block's warps.
    const size_t rows_bytes = kR ? static_cast<size_t>(shape.threads / 32) * WarpRows(p).bytes() : 0;
    // The instantiation of the call's weight mode (Llama/Qwen3's rounding
    // first, or Gemma's offset), with the warp rows' shared memory.
    const auto launch_mode = [&](auto round_kernel, auto offset_kernel) {
      return round_first ? launch_kernel_shared(round_kernel, grid, block, rows_bytes, stream, ptrs, ix, p)
                         : launch_kernel_shared(offset_kernel, grid, block, rows_bytes, stream, ptrs, ix, p);
    };
    if (shape.several_rounds) {
      // A call past one wave of these blocks ends with one-round slices of
      // its last tokens (kTail). Not with fp8 pools: the slice arithmetic
      // made those instantiations spill under the occupancy target.
      if constexpr (!kFp8) {
        // Short tokens: more blocks per multiprocessor and a smaller tail
        // (RopeCudaPolicy::norm_short_token_max_rounds).
        const int64_t items = core::rope_items_per_token(p);
        const bool short_token = items <= int64_t{Policy::norm_short_token_max_rounds} * shape.threads;
        const int64_t per_sm = short_token ? Policy::norm_short_token_min_blocks_per_sm : Policy::norm_min_blocks_per_sm;
        const int64_t tail_share = short_token ? Policy::norm_short_token_tail_share : 1;
        const int64_t blocks = core::plan_rope_cuda_tail(ix, items, p.num_tokens, shape.threads, p.qk_items_per_head,
                                                         per_sm * multiprocessors_on_current_device(), tail_share);
        const bool tail = blocks > p.num_tokens;
        if (tail) grid.x = static_cast<unsigned>(blocks);
        if (short_token && tail)
          return launch_mode(rope_pool_kernel<T, V, kAhead, false, kRound, kF, kR, kR, true, true>,
                             rope_pool_kernel<T, V, kAhead, false, kOffset, kF, kR, kR, true, true>);
        if (short_token)
          return launch_mode(rope_pool_kernel<T, V, kAhead, false, kRound, kF, kR, kR, false, true>,
                             rope_pool_kernel<T, V, kAhead, false, kOffset, kF, kR, kR, false, true>);
        if (tail)
          return launch_mode(rope_pool_kernel<T, V, kAhead, false, kRound, kF, kR, kR, true>,
                             rope_pool_kernel<T, V, kAhead, false, kOffset, kF, kR, kR, true>);
      }
      return launch_mode(rope_pool_kernel<T, V, kAhead, kFp8, kRound, kF, kR, kR>,
                         rope_pool_kernel<T, V, kAhead, kFp8, kOffset, kF, kR, kR>);
    }
    if constexpr (kR) {
      if (core::rope_norm_stage(static_cast<int64_t>(grid.x) * grid.y, multiprocessors_on_current_device()))
        return launch_mode(rope_pool_kernel<T, V, 0, kFp8, kRound, kF, kR, true>,
                           rope_pool_kernel<T, V, 0, kFp8, kOffset, kF, kR, true>);
    }
    if constexpr (!kR) {
      // Computing cos/sin: a table warp per block where its blocks fit in
      // one wave (core::rope_table_warp).
      if (core::rope_table_warp(static_cast<int64_t>(grid.x) * grid.y, multiprocessors_on_current_device(), kFp8)) {
        const dim3 with_table(shape.threads + Policy::table_warp_threads);
        return round_first ? launch_kernel(rope_pool_kernel<T, V, 0, kFp8, kRound, kF, kR, false, false, false, true>,
                                           grid, with_table, stream, ptrs, ix, p)
                           : launch_kernel(rope_pool_kernel<T, V, 0, kFp8, kOffset, kF, kR, false, false, false, true>,
                                           grid, with_table, stream, ptrs, ix, p);
      }
    }
    return round_first ? launch_kernel(rope_pool_kernel<T, V, 0, kFp8, kRound, kF, kR>, grid, block, stream, ptrs, ix, p)
                       : launch_kernel(rope_pool_kernel<T, V, 0, kFp8, kOffset, kF, kR>, grid, block, stream, ptrs, ix, p);
  }
  if constexpr (!kNeoxFull) {
    if (p.width == 1)
      return launch_kernel(rope_pool_kernel<T, 1, 0, kFp8, kNoNorm, false, false>, grid, block, stream, ptrs, ix, p);
  }
  // One round per block (small calls, split tokens): nothing to ask for
  // ahead, and the instantiation without the prefetch is leaner.
  if (shape.several_rounds)
    return launch_kernel(rope_pool_kernel<T, V, kAhead, kFp8, kNoNorm, kF, kR>, grid, block, stream, ptrs, ix, p);
  return launch_kernel(rope_pool_kernel<T, V, 0, kFp8, kNoNorm, kF, kR>, grid, block, stream, ptrs, ix, p);
}

template <typename T, bool kFp8>
cudaError_t launch(const RopePoolParams& p, const RopePoolPointers& ptrs, cudaStream_t stream) {
  if (!core::rope_neox_full(p, 16 / sizeof(T))) return launch_shape<T, kFp8, false, false>(p, ptrs, stream);
  // The common shape reads cos_sin_cache rows (and the norm weights)
  // directly where they are aligned.
  const bool rows = p.use_cache && p.cache_vector && (!p.norm_q || on16(ptrs.q_norm_weight)) &&
                    (!p.norm_k || on16(ptrs.k_norm_weight));
  return rows ? launch_shape<T, kFp8, true, true>(p, ptrs, stream) : launch_shape<T, kFp8, true, false>(p, ptrs, stream);
}

}  // namespace

cudaError_t rope_pool(const RopePoolParams& params, const RopePoolPointers& ptrs, core::DType dtype,
                      cudaStream_t stream) {
  if (params.num_tokens == 0) return cudaSuccess;
  // grid.x holds the tokens; item indices within a token are 32-bit, with
  // room for a block's last round past the token's end.
  if (params.num_tokens >= (int64_t{1} << 31) || core::rope_items_per_token(params) >= (int64_t{1} << 30))
    return cudaErrorInvalidConfiguration;
  if ((params.norm_q || params.norm_k) && !core::rope_norm_in_rotation_kernel(params))
    return rope_norm_pool(params, ptrs, dtype, stream);
  return with_element_type(dtype, params.pool_fp8 != 0, [&](auto element, auto fp8) {
    return launch<decltype(element), decltype(fp8)::value>(params, ptrs, stream);
  });
}

}  // namespace attnprep::cuda
