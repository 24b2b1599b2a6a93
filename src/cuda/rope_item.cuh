// The rotation kernel's work item (cuda/rope_pool_kernel.cuh): up to two
// vector groups of one q, k or v head of a token, located, loaded, normalized,
// rotated and stored into q_rot/k_rot and the pools.
#pragma once

#include <cstdint>

#include "core/rope_pool.h"
#include "cuda/rope_cos_sin.cuh"
#include "cuda/rope_group.cuh"
#include "cuda/rope_norm.cuh"
#include "cuda/rope_token.cuh"

namespace attnprep::cuda::rope {

using Policy = core::RopeCudaPolicy;

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

// One work item: up to two groups of W elements of one head (lo, and hi when `two`), their source, destination and
// frequencies. kNeoxFull (core::rope_neox_full) fixes the common shape at compile time, so the run-time tests of
// `kind`, `two` and `dst` go away.
template <typename T, int W, bool kNeoxFull = false>
struct Item {
  enum Kind { kNeox, kGptj, kCopy };
  Kind kind = kCopy;
  bool is_q = false, is_v = false, two = false;
  int head = 0;
  const T* src = nullptr;
  T* dst = nullptr;  // q_rot/k_rot; null for v and for in-place pass-through
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
  // kFp8: the scale of the item's fp8 output (its pool row, or fp8 q_rot), read right after its loads so that the
  // round trip overlaps theirs (read where the row is written, it would add a second round trip before every store).
  template <bool kFp8>
  __device__ __forceinline__ float pool_scale_of(const RopePoolParams& p, const RopePoolPointers& ptr) const {
    if constexpr (kFp8) {
      if (is_q) return p.q_fp8 ? *ptr.q_scale : 1.f;
      return p.pool_fp8 ? pool_scale(p, ptr, head, is_v) : 1.f;
    }
    return 1.f;
  }
  // Asks L2 for the item's lines now, to be evicted last (as load()'s
  // kEvictLast); a later load() then hits L2.
  __device__ __forceinline__ void prefetch() const {
    prefetch_l2<Policy::several_round_loads_evict_last>(src + lo_off);
    if (has_hi()) prefetch_l2<Policy::several_round_loads_evict_last>(src + hi_off);
  }
  // kNorm: 1/sqrt(mean square + eps) of this item's head, in the pairwise order of the reference: each group's
  // squares, a butterfly over the head's `lanes` lanes, then the root. Every lane of the warp calls it (`active`
  // false adds nothing); inv_head_dim is exact (head_dim is a power of two here).
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

  // kFp8: float8 pools or q_rot (x / scale; p.pool_fp8, p.q_fp8); kNorm: q and k normalized first (weights `w`, factor
  // `inv`); kRowCs: cos/sin from the token's cos_sin_cache row, else the block's table `cs`; kWarpRows: weights and
  // cos/sin from the warp's rows in shared memory. Groups of W > 1 elements compute on pairs (Group::get2/set2).
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
          if constexpr (kNeoxFull)
            return row[i];
          else
            return table_cos_sin(cs, freq + i);
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
    if (kFp8 && is_q && p.q_fp8) {  // (never in place)
      unsigned char* out = fp8_q_row(ptr, dst);
      const core::Fp8Quotient quotient(scale);
      store_fp8(lo, out + lo_off, quotient, 1);
      if (has_hi()) store_fp8(hi, out + hi_off, quotient, 1);
    } else if (has_dst()) {
      lo.store(dst + lo_off);
      if (has_hi()) hi.store(dst + hi_off);
    }
    if (write_pool && !is_q) {
      const int64_t row = pool_row(p, ix.page, slot, head, is_v);
      if (!kFp8 || !p.pool_fp8) {
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

}  // namespace attnprep::cuda::rope
