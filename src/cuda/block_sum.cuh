// A block's pairwise sum of per-warp partial sums, shared by the kernels that norm over a whole token.
#pragma once

namespace attnprep::cuda {

// sums[r][w]: warp w's sum in round r. Warps first, then rounds, each a tree of adjacent pairs (the norm's
// pairwise order); rounds from `used` on count as zero, which adds nothing.
template <int Rounds, int Warps>
__device__ __forceinline__ float block_pairwise_total(const float (*sums)[Warps], int used) {
  float total[Rounds];
#pragma unroll
  for (int r = 0; r < Rounds; ++r) {
    float w[Warps];
#pragma unroll
    for (int i = 0; i < Warps; ++i) w[i] = r < used ? sums[r][i] : 0.f;
#pragma unroll
    for (int step = 1; step < Warps; step *= 2)
#pragma unroll
      for (int i = 0; i < Warps; i += 2 * step) w[i] = __fadd_rn(w[i], w[i + step]);
    total[r] = w[0];
  }
#pragma unroll
  for (int step = 1; step < Rounds; step *= 2)
#pragma unroll
    for (int r = 0; r < Rounds; r += 2 * step) total[r] = __fadd_rn(total[r], total[r + step]);
  return total[0];
}

}  // namespace attnprep::cuda
