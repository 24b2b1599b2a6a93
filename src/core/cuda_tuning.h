// The CUDA kernels' tuning, keyed by SM generation (sm_80, sm_90, sm_100).
// Each value carries one line of evidence: shape, figure, GPU. Every value
// was measured on Hopper (H100, H200) only; sm_80 and sm_100 take sm_90's.
#pragma once

#include <cstdint>
#include <type_traits>

namespace attnprep::core {

// ---- sm_90 (H100, H200): measured. "points": percent of a device copy of
// the same bytes; "replay": per-call time under CUDA-graph replay.

// Copies: strided_copy (pack's engine, usp_merge_heads, the GQA pack) and the
// flat pack pass.
struct CopyCudaPolicySm90 {
  // merge (8, 8192, 1, 3, 128): 97.5-98.1 -> 98.2-99.1 points against 512 x 4 with PDL (H200).
  static constexpr int32_t large_threads = 128;
  static constexpr int32_t large_vectors_per_thread = 1;
  static constexpr bool large_with_pdl = false;
  // pack +1 to +2 points, merge +1.5 to +2.5 at every large shape (H200).
  static constexpr bool large_loads_evict_last = true;
  // pack rows = 65: replay 2.33 -> 1.58 us against 4 vectors a thread; 128 and 512 slower (H200).
  static constexpr int32_t small_threads = 256;
  static constexpr int64_t small_below = int64_t{1} << 18;
  // flat pack rows = 65: replay 0.77 us at 256 threads against 0.84-0.90 at 128 (H200).
  static constexpr int32_t flat_threads = 256;
  // large packs as one flat pass in the large copies' shape: (20992, 56, 128, 2) 100.5-101.2 -> 101.6 points (H200).
  static constexpr int32_t flat_input_threads = large_threads;
};

// The fp8 wire's quantizing pass (units of two adjacent 16-byte vectors).
struct WireCudaPolicySm90 {
  // units of 2 vectors: pack + quantize 1.37 -> 0.85x a bf16 copy of the input, dequantize 1.04 -> 0.84x (H200).
  static constexpr int32_t threads = 256;
  static constexpr int32_t units_per_thread = 2;
  static constexpr int32_t vectors_per_unit = 2;
};

// rope_pool_fused's rotation kernel and its general QK-norm kernel.
struct RopeCudaPolicySm90 {
  // 128 threads at 10 blocks per SM: <= 48 registers, no spills; 32/8 heads = 3 whole rounds, +3 points (H200).
  static constexpr int32_t max_threads = 128;
  static constexpr int32_t min_blocks_per_sm = 10;
  // a block per token from 1024 tokens, split one-round blocks below: a small call is one round trip (H200).
  static constexpr int64_t split_below = 1024;
  // the next round's item asked of L2: +2-3 points from 1024 tokens; none or two ahead slower (H200).
  static constexpr int prefetch_rounds_ahead = 1;
  // ... loads and prefetches evict-last, as the large copies' loads: same registers, no spills (H200).
  static constexpr bool several_round_loads_evict_last = true;
  // a QK-norm lane holds >= 2 groups (a rotation item's bytes in flight), <= 16 elements (head_dim 512).
  static constexpr int norm_min_groups_per_lane = 2;
  static constexpr int norm_max_per_lane = 16;
  // QK norm in the rotation kernel: 56 registers, no spills at 9 blocks (H200).
  static constexpr int32_t norm_min_blocks_per_sm = 9;
  // one-round QK-norm blocks, pools in q's dtype: a 10th block beats its 8 bytes of spills (H200).
  static constexpr int32_t norm_one_round_min_blocks_per_sm = 10;
  // computing cos/sin with the QK norm in one wave: a table warp, the norm overlaps the table (H200).
  static constexpr int32_t table_warp_threads = 32;
  static constexpr int32_t norm_table_warp_min_blocks_per_sm =
      norm_one_round_min_blocks_per_sm * max_threads / (max_threads + table_warp_threads);
  static constexpr int32_t norm_table_warp_fp8_min_blocks_per_sm =
      norm_min_blocks_per_sm * max_threads / (max_threads + table_warp_threads);
  // cache-row path, one-round QK-norm blocks: warp rows staged up to 5 blocks per SM, direct reads past (H200).
  static constexpr int32_t norm_stage_max_blocks_per_sm = 5;
  // tokens of <= 3 rounds (32/8 at 128) at 10 blocks per SM: gained there, cost 64/8 (5 rounds) (H200).
  static constexpr int32_t norm_short_token_max_rounds = 3;
  static constexpr int32_t norm_short_token_min_blocks_per_sm = 10;
  // ... and half the usual one-round tail: 32/8 better than all or a third of it; 64/8 lost with half (H200).
  static constexpr int32_t norm_short_token_tail_share = 2;
  // the general QK-norm kernel: 64 registers at 8 blocks; 9 spilled 12-44 bytes.
  static constexpr int32_t general_norm_min_blocks_per_sm = 8;
};

// mla_rope_pool_fused: a warp per token.
struct MlaCudaPolicySm90 {
  // a lane's items loaded together: DeepSeek-V3's 136 in-place items per token in one batch (95-102 registers).
  static constexpr int batch_groups = 8;
  // kv_c elements a lane holds (kv_lora_rank 512); longer runs are read in chunks of this size.
  static constexpr int latent_run = 16;
  // no register cap: at 8 blocks per SM (64 registers) every batch size of 4-8 spilled 42-340 bytes (sm_90 ptxas).
  static constexpr int32_t min_blocks_per_sm = 1;
  // a warp per token from 1024 tokens; below, a warp per 32 of a token's items: H200 replay at T = 1 4.35 us with a
  // warp per token against 2.41 for the block-per-token design.
  static constexpr int64_t split_below = 1024;
};

// ---- sm_80 (A100) and sm_100 (B200): not measured; sm_90's values.
template <int kSm>
struct CudaTuning;
template <>
struct CudaTuning<90> {
  using Copy = CopyCudaPolicySm90;
  using Wire = WireCudaPolicySm90;
  using Rope = RopeCudaPolicySm90;
  using Mla = MlaCudaPolicySm90;
};
template <>
struct CudaTuning<80> : CudaTuning<90> {};
template <>
struct CudaTuning<100> : CudaTuning<90> {};

// The generation a kernel is compiled for: a device pass's __CUDA_ARCH__
// (800-899: 80, 900-999: 90, newer: 100); host code reads sm_90's values.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
inline constexpr int kCompiledSm = 80;
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
inline constexpr int kCompiledSm = 100;
#else
inline constexpr int kCompiledSm = 90;
#endif
using CopyCudaPolicy = CudaTuning<kCompiledSm>::Copy;
using WireCudaPolicy = CudaTuning<kCompiledSm>::Wire;
using RopeCudaPolicy = CudaTuning<kCompiledSm>::Rope;
using MlaCudaPolicy = CudaTuning<kCompiledSm>::Mla;

// The launchers size grids and pick instantiations on the host with sm_90's
// values: a generation that changes a policy must key the launcher by the
// device's generation first.
template <int kSm>
constexpr bool same_policies_as_sm90() {
  using A = CudaTuning<kSm>;
  using B = CudaTuning<90>;
  return std::is_same_v<typename A::Copy, typename B::Copy> && std::is_same_v<typename A::Wire, typename B::Wire> &&
         std::is_same_v<typename A::Rope, typename B::Rope> && std::is_same_v<typename A::Mla, typename B::Mla>;
}
static_assert(same_policies_as_sm90<80>() && same_policies_as_sm90<100>(),
              "a generation's own policy needs a launcher keyed by the device's generation");

}  // namespace attnprep::core
