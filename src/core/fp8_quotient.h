// x / scale as the fp8 pools store it (docs/contract.md: the float32 IEEE
// quotient, then rounded to fp8), without a division per value. An IEEE
// division is about ten instructions and a slow-path branch; the rope kernel
// runs out of issue slots before it runs out of memory bandwidth with one per
// value. Instead, once per scale, its correctly rounded reciprocal r; per
// value, q = x r corrected once by the exact remainder (Markstein's
// correction): q + (x - q scale) r, three instructions.
//
// That is the correctly rounded quotient whenever the remainder x - q scale
// is exact in float32, which holds unless it underflows. For scales in
// [2^-64, 2^64] the remainder can underflow only when |x| is below 2^-100 and
// the quotient below 2^-30; the two results then differ by at most one unit in
// the last place and round to the same signed fp8 zero (tests/cpp/test_fp8_quotient.cpp
// checks both claims). Other scales (zero, negative, subnormal, huge, NaN)
// take the IEEE division.
#pragma once

#include <cmath>

#include "core/fast_divmod.h"  // ATTNPREP_HD

namespace attnprep::core {

struct Fp8Quotient {
  float scale = 1.f, recip = 1.f;
  bool fast = true;  // the reciprocal path is exact enough (above)

  ATTNPREP_HD explicit Fp8Quotient(float s) : scale(s) {
    fast = s >= 0x1p-64f && s <= 0x1p64f;  // false for NaN too
#if defined(__CUDA_ARCH__)
    recip = fast ? __frcp_rn(s) : 1.f;
#else
    recip = fast ? 1.f / s : 1.f;
#endif
  }

  // The IEEE quotient x / scale (for fast scales: up to the underflow case
  // above). Infinities and NaN pass through the first product unchanged.
  ATTNPREP_HD float operator()(float x) const {
#if defined(__CUDA_ARCH__)
    if (!fast) return __fdiv_rn(x, scale);
    const float q = __fmul_rn(x, recip);
    const float minus_rem = __fmaf_rn(q, scale, -x);  // q scale - x, exact
    const float corrected = __fmaf_rn(-minus_rem, recip, q);
    return fabsf(q) < INFINITY ? corrected : q;  // inf or NaN: the remainder is NaN
#else
    if (!fast) return x / scale;
    const float q = x * recip;
    const float minus_rem = std::fma(q, scale, -x);
    const float corrected = std::fma(-minus_rem, recip, q);
    return std::fabs(q) < INFINITY ? corrected : q;
#endif
  }
};

}  // namespace attnprep::core
