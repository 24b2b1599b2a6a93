// Division by a run-time constant with a multiply and a shift (Granlund and Montgomery, 1994): hardware division
// would cost more than the copy kernels' memory access. Valid for dividend and divisor below 2^31 (the plans').
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ATTNPREP_HD __host__ __device__ __forceinline__
#else
#define ATTNPREP_HD inline
#endif

namespace attnprep::core {

struct FastDivmod {
  uint32_t divisor = 1;
  uint32_t multiplier = 1;
  uint32_t shift = 0;

  FastDivmod() = default;
  explicit FastDivmod(uint32_t d) : divisor(d) {
    shift = 0;
    while ((uint64_t{1} << shift) < d) ++shift;
    multiplier = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1);
  }

  // quotient of n / divisor for n < 2^31; the remainder is n - q * divisor.
  ATTNPREP_HD uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    uint32_t hi = __umulhi(n, multiplier);
#else
    uint32_t hi = static_cast<uint32_t>((uint64_t{n} * multiplier) >> 32);
#endif
    return (hi + n) >> shift;
  }
  // The same for any n < 2^32 (the sum above needs 33 bits there).
  ATTNPREP_HD uint32_t div_wide(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(n, multiplier);
#else
    const uint32_t hi = static_cast<uint32_t>((uint64_t{n} * multiplier) >> 32);
#endif
    return static_cast<uint32_t>((uint64_t{hi} + n) >> shift);
  }
};

}  // namespace attnprep::core
