// sin/cos of a float32 rotary angle within 0.501 float32 ulp below 2^52 (a Cody-Waite reduction in double and
// Taylor polynomials, rounded once): CUDA's sincosf falls into a slow Payne-Hanek path past |angle| 105615, which
// positions past ~1e5 reach. Host and device run the same arithmetic, so ctest checks what the GPU runs.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/fast_divmod.h"  // ATTNPREP_HD

namespace attnprep::core {

ATTNPREP_HD void angle_sincos(float angle, float* sin_out, float* cos_out) {
  const double x = angle;
  if (!(::fabs(x) < 0x1p52)) {
#if defined(__CUDA_ARCH__)
    sincosf(angle, sin_out, cos_out);  // its own exact reduction; small code
#else
    *sin_out = static_cast<float>(::sin(x));
    *cos_out = static_cast<float>(::cos(x));
#endif
    return;
  }
  constexpr double kTwoOverPi = 0x1.45f306dc9c883p-1;
  constexpr double kPiOver2Hi = 0x1.921fb54442d18p+0;    // pi/2 = hi + mid + lo
  constexpr double kPiOver2Mid = 0x1.1a62633145c07p-54;  // to about 160 bits
  constexpr double kPiOver2Lo = -0x1.f1976b7ed8fbcp-110;
  const double k = ::rint(x * kTwoOverPi);
  double r = ::fma(-k, kPiOver2Hi, x);
  r = ::fma(-k, kPiOver2Mid, r);
  r = ::fma(-k, kPiOver2Lo, r);
  const double r2 = r * r;

  // sin r = r - r^3/3! + r^5/5! - ... + r^13/13!
  double ps = 1.0 / 6227020800.0;         //  1/13!
  ps = ::fma(ps, r2, -1.0 / 39916800.0);  // -1/11!
  ps = ::fma(ps, r2, 1.0 / 362880.0);     //  1/9!
  ps = ::fma(ps, r2, -1.0 / 5040.0);      // -1/7!
  ps = ::fma(ps, r2, 1.0 / 120.0);        //  1/5!
  ps = ::fma(ps, r2, -1.0 / 6.0);         // -1/3!
  const double s = ::fma(ps * r2, r, r);
  // cos r = 1 - r^2/2! + r^4/4! - ... - r^14/14!
  double pc = -1.0 / 87178291200.0;       // -1/14!
  pc = ::fma(pc, r2, 1.0 / 479001600.0);  //  1/12!
  pc = ::fma(pc, r2, -1.0 / 3628800.0);   // -1/10!
  pc = ::fma(pc, r2, 1.0 / 40320.0);      //  1/8!
  pc = ::fma(pc, r2, -1.0 / 720.0);       // -1/6!
  pc = ::fma(pc, r2, 1.0 / 24.0);         //  1/4!
  pc = ::fma(pc, r2, -0.5);               // -1/2!
  const double c = ::fma(pc, r2, 1.0);

  // angle = k pi/2 + r: (sin r, cos r) rotated by the quadrant with selects, not branches (a warp's lanes hold every
  // quadrant, and branches would run the four cases in turn). Rounding is symmetric, so negating after it is exact.
  const int quadrant = static_cast<int>(static_cast<int64_t>(k) & 3);
  const float fs = static_cast<float>(s), fc = static_cast<float>(c);
  const float so = quadrant & 1 ? fc : fs, co = quadrant & 1 ? fs : fc;
  *sin_out = quadrant & 2 ? -so : so;
  *cos_out = (quadrant + 1) & 2 ? -co : co;
}

}  // namespace attnprep::core
