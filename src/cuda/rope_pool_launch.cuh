// The rotation kernel's launcher (launch shape and RopeVariants member for one call), included by the per-type
// translation units rope_pool_<type>.cu so that the build compiles them side by side.
#pragma once

#include <cstdint>

#include "core/rope_pool.h"
#include "cuda/launch.h"
#include "cuda/rope_pool_kernel.cuh"

namespace attnprep::cuda::rope {

template <typename T, bool kFp8, bool kNeoxFull, bool kRowCs>
cudaError_t launch_shape(const RopePoolParams& p, const RopePoolPointers& ptrs, cudaStream_t stream) {
  const bool norm = p.norm_q || p.norm_k;
  const core::RopeCudaLaunch shape = core::plan_rope_cuda_launch(core::rope_items_per_token(p), p.num_tokens);
  dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(shape.splits));
  const dim3 block(shape.threads);
  using Variants = RopeVariants<T, kFp8, kNeoxFull, kRowCs>;
  constexpr bool kR = kRowCs;
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
        const int64_t per_sm =
            short_token ? Policy::norm_short_token_min_blocks_per_sm : Policy::norm_min_blocks_per_sm;
        const int64_t tail_share = short_token ? Policy::norm_short_token_tail_share : 1;
        const int64_t blocks = core::plan_rope_cuda_tail(ix, items, p.num_tokens, shape.threads, p.qk_items_per_head,
                                                         per_sm * multiprocessors_on_current_device(), tail_share);
        const bool tail = blocks > p.num_tokens;
        if (tail) grid.x = static_cast<unsigned>(blocks);
        if (short_token && tail)
          return launch_mode(rope_pool_kernel<typename Variants::template NormShortTokensTail<kRound>>,
                             rope_pool_kernel<typename Variants::template NormShortTokensTail<kOffset>>);
        if (short_token)
          return launch_mode(rope_pool_kernel<typename Variants::template NormShortTokens<kRound>>,
                             rope_pool_kernel<typename Variants::template NormShortTokens<kOffset>>);
        if (tail)
          return launch_mode(rope_pool_kernel<typename Variants::template NormSeveralRoundsTail<kRound>>,
                             rope_pool_kernel<typename Variants::template NormSeveralRoundsTail<kOffset>>);
      }
      return launch_mode(rope_pool_kernel<typename Variants::template NormSeveralRounds<kRound>>,
                         rope_pool_kernel<typename Variants::template NormSeveralRounds<kOffset>>);
    }
    if constexpr (kR) {
      if (core::rope_norm_stage(static_cast<int64_t>(grid.x) * grid.y, multiprocessors_on_current_device()))
        return launch_mode(rope_pool_kernel<typename Variants::template NormOneRoundStaged<kRound>>,
                           rope_pool_kernel<typename Variants::template NormOneRoundStaged<kOffset>>);
    }
    if constexpr (!kR) {
      // Computing cos/sin: a table warp per block where its blocks fit in
      // one wave (core::rope_table_warp).
      if (core::rope_table_warp(static_cast<int64_t>(grid.x) * grid.y, multiprocessors_on_current_device(), kFp8)) {
        const dim3 with_table(shape.threads + Policy::table_warp_threads);
        return round_first ? launch_kernel(rope_pool_kernel<typename Variants::template NormOneRoundTableWarp<kRound>>,
                                           grid, with_table, stream, ptrs, ix, p)
                           : launch_kernel(rope_pool_kernel<typename Variants::template NormOneRoundTableWarp<kOffset>>,
                                           grid, with_table, stream, ptrs, ix, p);
      }
    }
    return round_first ? launch_kernel(rope_pool_kernel<typename Variants::template NormOneRound<kRound>>, grid, block,
                                       stream, ptrs, ix, p)
                       : launch_kernel(rope_pool_kernel<typename Variants::template NormOneRound<kOffset>>, grid, block,
                                       stream, ptrs, ix, p);
  }
  if constexpr (!kNeoxFull) {
    if (p.width == 1)
      return launch_kernel(rope_pool_kernel<typename Variants::Scalar>, grid, block, stream, ptrs, ix, p);
  }
  // One round per block (small calls, split tokens): nothing to ask for
  // ahead, and the instantiation without the prefetch is leaner.
  if (shape.several_rounds)
    return launch_kernel(rope_pool_kernel<typename Variants::SeveralRounds>, grid, block, stream, ptrs, ix, p);
  return launch_kernel(rope_pool_kernel<typename Variants::OneRound>, grid, block, stream, ptrs, ix, p);
}

template <typename T, bool kFp8>
cudaError_t launch_rope_pool(const RopePoolParams& p, const RopePoolPointers& ptrs, cudaStream_t stream) {
  if (!core::rope_neox_full(p, 16 / sizeof(T))) return launch_shape<T, kFp8, false, false>(p, ptrs, stream);
  // The common shape reads cos_sin_cache rows (and the norm weights)
  // directly where they are aligned.
  const bool rows = p.use_cache && p.cache_vector && (!p.norm_q || on16(ptrs.q_norm_weight)) &&
                    (!p.norm_k || on16(ptrs.k_norm_weight));
  return rows ? launch_shape<T, kFp8, true, true>(p, ptrs, stream)
              : launch_shape<T, kFp8, true, false>(p, ptrs, stream);
}

}  // namespace attnprep::cuda::rope
