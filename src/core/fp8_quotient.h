// x / scale as the fp8 pools store it (the IEEE quotient) without a division per value, which would make the rope
// kernel issue-bound: a correctly rounded reciprocal once per scale, then Markstein's correction per value. Exact for
// scales in [2^-64, 2^64] (tests/cpp/test_fp8_quotient.cpp); other scales take the IEEE division.
#pragma once

#include <cmath>

#include "core/fast_divmod.h"  // ATTNPREP_HD

namespace attnprep::core {

// IEEE float32 steps, each rounded to nearest even, on the device and the host alike.
namespace fp32 {
#if defined(__CUDA_ARCH__)
ATTNPREP_HD float mul(float a, float b) { return __fmul_rn(a, b); }
ATTNPREP_HD float fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
ATTNPREP_HD float div(float a, float b) { return __fdiv_rn(a, b); }
ATTNPREP_HD float recip(float a) { return __frcp_rn(a); }
#else
ATTNPREP_HD float mul(float a, float b) { return a * b; }
ATTNPREP_HD float fma(float a, float b, float c) { return std::fma(a, b, c); }
ATTNPREP_HD float div(float a, float b) { return a / b; }
ATTNPREP_HD float recip(float a) { return 1.f / a; }
#endif
}  // namespace fp32

struct Fp8Quotient {
  float scale = 1.f, recip = 1.f;
  bool fast = true;  // the reciprocal path is exact enough (above)

  ATTNPREP_HD explicit Fp8Quotient(float s) : scale(s) {
    fast = s >= 0x1p-64f && s <= 0x1p64f;  // false for NaN too
    recip = fast ? fp32::recip(s) : 1.f;
  }

  // The IEEE quotient x / scale (for fast scales: up to the underflow case
  // above). Infinities and NaN pass through the first product unchanged.
  ATTNPREP_HD float operator()(float x) const { return fast ? by_reciprocal(x) : by_division(x); }
  // The two paths, for callers that branch once for many values.
  ATTNPREP_HD float by_reciprocal(float x) const {
    const float q = fp32::mul(x, recip);
    const float minus_rem = fp32::fma(q, scale, -x);  // q scale - x, exact
    const float corrected = fp32::fma(-minus_rem, recip, q);
    return fabsf(q) < INFINITY ? corrected : q;  // inf or NaN: the remainder is NaN
  }
  ATTNPREP_HD float by_division(float x) const { return fp32::div(x, scale); }
};

}  // namespace attnprep::core
