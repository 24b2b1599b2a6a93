// core::Fp8Quotient (the fp8 pools' x / scale without a division per value),
// run on the host as the CUDA kernels run it: against the IEEE quotient, bit
// for bit wherever the quotient is at least 2^-30 in magnitude, and always
// the same fp8 byte in both formats.
#include <cmath>
#include <cstdint>
#include <limits>

#include "check.h"
#include "core/fp8_quotient.h"
#include "cpu/float_bits.h"

using attnprep::core::Fp8Quotient;
using attnprep::cpu::bits_to_float;
using attnprep::cpu::float_to_bits;
using attnprep::cpu::float_to_fp8;

namespace {

uint64_t next(uint64_t& s) {  // xorshift64
  s ^= s << 13;
  s ^= s >> 7;
  s ^= s << 17;
  return s;
}

// One (x, scale): the claims of core/fp8_quotient.h. Returns false on a mismatch.
bool agrees(float x, float scale) {
  const float ieee = x / scale, fast = Fp8Quotient(scale)(x);
  if (float_to_bits(ieee) == float_to_bits(fast) || (std::isnan(ieee) && std::isnan(fast))) return true;
  if (std::fabs(ieee) >= 0x1p-30f) return false;  // only tiny quotients may differ, by one unit
  if (std::fabs(float_to_bits(ieee) - static_cast<double>(float_to_bits(fast))) > 1) return false;
  return float_to_fp8(ieee, 1) == float_to_fp8(fast, 1) && float_to_fp8(ieee, 2) == float_to_fp8(fast, 2);
}

}  // namespace

TEST_CASE("dense significands of x against scales at the edges of the fast range") {
  uint64_t s = 0x9e3779b97f4a7c15ull;
  int bad = 0;
  for (int k = 0; k < 48; ++k) {
    // significands all ones, near 1, random; exponents across [-64, 64]
    const uint32_t man = k < 8 ? 0x7fffffu - k : k < 16 ? k - 8 : static_cast<uint32_t>(next(s)) & 0x7fffffu;
    const int exp = k % 3 == 0 ? (k % 2 ? 64 : -64) : static_cast<int>(next(s) % 129) - 64;
    const float scale = std::ldexp(bits_to_float(0x3f800000u | man), exp);
    const float fitted = scale > 0x1p64f ? 0x1p64f : scale < 0x1p-64f ? 0x1p-64f : scale;
    for (uint32_t xm = 0; xm < (1u << 23); xm += 61) {
      for (int xe : {0, 100, -100}) {
        const float x = std::ldexp(bits_to_float(0x3f800000u | xm), xe);
        bad += !agrees(x, fitted) + !agrees(-x, fitted);
      }
    }
  }
  CHECK_EQ(bad, 0);
}

TEST_CASE("random x over every finite float, random scales in [2^-64, 2^64]") {
  uint64_t s = 0x2545f4914f6cdd1dull;
  int bad = 0;
  for (int i = 0; i < 1000000; ++i) {
    const uint64_t r = next(s);
    const float x = bits_to_float(static_cast<uint32_t>(r));
    if (!std::isfinite(x)) continue;
    const uint32_t su = static_cast<uint32_t>(r >> 32);
    const float scale = bits_to_float((su & 0x7fffffu) | ((63u + (su >> 23) % 129u) << 23));
    bad += !agrees(x, scale);
  }
  CHECK_EQ(bad, 0);
}

TEST_CASE("zeros keep their sign, infinities saturate, NaN stays NaN") {
  for (float scale : {1.f, 0.0625f, 3.f, 0x1p-64f, 0x1p64f}) {
    CHECK_EQ(float_to_bits(Fp8Quotient(scale)(0.f)), float_to_bits(0.f));
    CHECK_EQ(float_to_bits(Fp8Quotient(scale)(-0.f)), float_to_bits(-0.f));
    CHECK(Fp8Quotient(scale)(INFINITY) == INFINITY);
    CHECK(Fp8Quotient(scale)(-INFINITY) == -INFINITY);
    CHECK(std::isnan(Fp8Quotient(scale)(std::numeric_limits<float>::quiet_NaN())));
    CHECK(agrees(std::numeric_limits<float>::max(), scale));
    CHECK(agrees(std::numeric_limits<float>::denorm_min(), scale));
  }
}

TEST_CASE("scales outside the fast range take the IEEE division") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (float scale : {0.f, -0.f, -1.f, -0x1p-64f, 1e-40f, 0x1p-65f, 0x1p65f, INFINITY, nan}) {
    CHECK(!Fp8Quotient(scale).fast);
    for (float x : {1.f, -3.5f, 0.f, 1e30f, 1e-30f, INFINITY}) {
      const float ieee = x / scale, got = Fp8Quotient(scale)(x);
      CHECK(float_to_bits(ieee) == float_to_bits(got) || (std::isnan(ieee) && std::isnan(got)));
    }
  }
  CHECK(Fp8Quotient(0x1p-64f).fast);
  CHECK(Fp8Quotient(0x1p64f).fast);
}

TEST_MAIN()
