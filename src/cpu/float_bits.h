// float16 / bfloat16 <-> float conversions on the host (round to nearest
// even), float -> float8 as the fp8 pools store (nearest even, saturated),
// for the CPU references, the Metal emulation and the tests.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace attnprep::cpu {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float v = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
}

inline uint16_t float_to_half(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;        // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;       // overflow to inf (>= 65520)
  if (a < 0x38800000u) {                             // subnormal or zero in half
    const float v = bits_to_float(a) * 16777216.0f;  // exact: scale by 2^24
    uint32_t m = static_cast<uint32_t>(v);
    const float rem = v - static_cast<float>(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return sign | static_cast<uint16_t>(m);
  }
  uint32_t r = a - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return sign | static_cast<uint16_t>(r >> 13);
}

// float8 formats of the pools: 1 = e4m3fn (largest finite 448), 2 = e5m2 (57344). Nearest, ties to even;
// magnitudes past the largest finite value saturate to it; NaN stays NaN.
inline uint8_t float_to_fp8(float x, int kind) {
  const int mbits = kind == 1 ? 3 : 2, bias = kind == 1 ? 7 : 15;
  const uint8_t max_code = kind == 1 ? 0x7e : 0x7b, nan_code = kind == 1 ? 0x7f : 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return sign | nan_code;
  const double a = std::fabs(static_cast<double>(x));
  if (a == 0) return sign;
  const int emin = 1 - bias;
  int e = std::isinf(a) ? 64 : static_cast<int>(std::floor(std::log2(a)));
  if (std::ldexp(1.0, e) > a) --e;  // log2 rounding at powers of two
  if (std::ldexp(1.0, e + 1) <= a) ++e;
  uint32_t code;
  if (e < emin) {  // subnormal: multiples of 2^(emin - mbits)
    code = static_cast<uint32_t>(std::nearbyint(std::ldexp(a, mbits - emin)));
  } else {
    double m = std::nearbyint(std::ldexp(a, mbits - e));  // in [2^mbits, 2^(mbits+1)]
    if (m == std::ldexp(1.0, mbits + 1)) {
      m /= 2;
      ++e;
    }
    const uint32_t biased = static_cast<uint32_t>(e + bias);
    code = biased > 0x1fu ? 0xffu : (biased << mbits) | (static_cast<uint32_t>(m) - (1u << mbits));
  }
  return sign | static_cast<uint8_t>(code > max_code ? max_code : code);
}

}  // namespace attnprep::cpu
