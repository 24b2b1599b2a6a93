// Core utilities: shape rendering, dtype names, contiguity, fast division.
#include <random>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "check.h"
#include "core/errors.h"
#include "core/fast_divmod.h"
#include "core/tensor.h"
#include "cpu/float_bits.h"
#include "tensor_builder.h"

using namespace attnprep::core;

TEST_CASE("shape_str renders like torch.Size") {
  CHECK_EQ(shape_str(test::make({4, 8, 64})), std::string("torch.Size([4, 8, 64])"));
  CHECK_EQ(shape_str(test::make({})), std::string("torch.Size([])"));
  CHECK_EQ(shape_str(test::make({0})), std::string("torch.Size([0])"));
}

TEST_CASE("dtype_name renders like torch") {
  CHECK_EQ(std::string(dtype_name(DType::Float64)), std::string("torch.float64"));
  CHECK_EQ(std::string(dtype_name(DType::BFloat16)), std::string("torch.bfloat16"));
  CHECK_EQ(std::string(dtype_name(DType::Float8E4M3FN)), std::string("torch.float8_e4m3fn"));
  CHECK_EQ(std::string(dtype_name(DType::UInt16)), std::string("torch.uint16"));
  CHECK_EQ(std::string(dtype_name(DType::Int4)), std::string("torch.int4"));
  CHECK_EQ(std::string(dtype_name(DType::Float4E2M1FNx2)), std::string("torch.float4_e2m1fn_x2"));
  CHECK_EQ(std::string(dtype_name(DType::QUInt2x4)), std::string("torch.quint2x4"));
  CHECK_EQ(std::string(dtype_name(DType::Other)), std::string("unknown dtype"));
  // every name reads back as its dtype, and no two dtypes share one
  for (int i = 0; i < static_cast<int>(DType::Other); ++i) {
    const DType d = static_cast<DType>(i);
    CHECK(dtype_from_name(dtype_name(d)) == d);
  }
  // a newer torch's dtype: a value of its own past Other, named as torch names it
  const DType newer = dtype_from_name("torch.float128"), other_newer = dtype_from_name("torch.bcomplex32");
  CHECK(static_cast<int>(newer) > static_cast<int>(DType::Other));
  CHECK(newer != other_newer);
  CHECK(dtype_from_name("torch.float128") == newer);
  CHECK_EQ(std::string(dtype_name(newer)), std::string("torch.float128"));
  CHECK_EQ(std::string(dtype_name(other_newer)), std::string("torch.bcomplex32"));
  CHECK_EQ(std::string(dtype_name(static_cast<DType>(static_cast<int>(other_newer) + 1))),
           std::string("unknown dtype"));
}

TEST_CASE("is_contiguous follows torch") {
  CHECK(test::make({2, 3, 4}).is_contiguous());
  CHECK(!test::make({2, 3, 4}, DType::Float32, {}, {12, 1, 3}).is_contiguous());
  CHECK(test::make({2, 1, 4}, DType::Float32, {}, {4, 99, 1}).is_contiguous());  // size-1 dim
  CHECK(test::make({2, 0, 4}, DType::Float32, {}, {7, 5, 3}).is_contiguous());   // empty
}

TEST_CASE("sizes of empty, expanded and as_strided tensors: no product past int64") {
  // numel: an empty tensor's other sizes may multiply past int64 (torch allows [0, 2^62, 2^62])
  CHECK_EQ(test::make({0, int64_t{1} << 62, int64_t{1} << 62}, DType::Float32, {}, {0, 0, 0}).numel(), int64_t{0});
  // byte_stride: 0 on a dimension of one index or in an empty tensor, whatever the stride
  const TensorArg t = test::make({1, 3, 4}, DType::Float32, {}, {int64_t{1} << 62, 4, 1});
  CHECK_EQ(t.byte_stride(0), int64_t{0});
  CHECK_EQ(t.byte_stride(1), int64_t{16});
  CHECK_EQ(test::make({3, 0}, DType::Float32, {}, {int64_t{1} << 62, 1}).byte_stride(0), int64_t{0});
  // fits_int64_bytes: a size of 0 counts as 1
  CHECK(fits_int64_bytes({int64_t{1} << 60, 1}, 4));
  CHECK(!fits_int64_bytes({int64_t{1} << 61, 1}, 4));  // 2^63 bytes
  CHECK(fits_int64_bytes({0, int64_t{1} << 60}, 4));
  CHECK(!fits_int64_bytes({0, int64_t{1} << 62}, 2));
  CHECK(!fits_int64_bytes({INT64_MAX, INT64_MAX}, 1));
  CHECK(fits_int64_bytes({}, 8));
}

TEST_CASE("product_str: the exact decimal product of two counts, past 64 bits too") {
  CHECK_EQ(product_str(0, 12345), std::string("0"));
  CHECK_EQ(product_str(7, 6), std::string("42"));
  CHECK_EQ(product_str(uint64_t{1} << 32, 1), std::string("4294967296"));
  CHECK_EQ(product_str(1000000000, 1000000000), std::string("1000000000000000000"));
  CHECK_EQ(product_str(uint64_t{1} << 62, uint64_t{1} << 62), std::string("21267647932558653966460912964485513216"));
  CHECK_EQ(product_str(UINT64_MAX, UINT64_MAX), std::string("340282366920938463426481119284349108225"));
  // against 64-bit arithmetic where it fits
  std::mt19937_64 rng(5);
  for (int i = 0; i < 10000; ++i) {
    const uint64_t a = rng() >> (rng() % 64), b = rng() >> (rng() % 64);
    if (b != 0 && a > UINT64_MAX / b) continue;
    CHECK_EQ(product_str(a, b), std::to_string(a * b));
  }
}

TEST_CASE("FastDivmod equals integer division below 2^31") {
  std::mt19937 rng(1234);
  const uint32_t divisors[] = {1, 2, 3, 5, 7, 10, 16, 48, 56, 65, 80, 127, 4096, 65537, 1000003, (1u << 31) - 1};
  for (uint32_t d : divisors) {
    FastDivmod f(d);
    for (int i = 0; i < 20000; ++i) {
      const uint32_t n = i < 64 ? static_cast<uint32_t>(i) : rng() & 0x7fffffffu;
      if (f.div(n) != n / d) {
        test::fail(__FILE__, __LINE__, "div " + std::to_string(n) + " / " + std::to_string(d));
        break;
      }
    }
    const uint32_t top = 0x7fffffffu;
    CHECK_EQ(f.div(top), top / d);
  }
}

TEST_CASE("FastDivmod::div_wide equals integer division below 2^32") {
  std::mt19937 rng(4321);
  const uint32_t divisors[] = {1, 2, 3, 16, 48, 64, 100, 4096, 65537, (1u << 31) - 1};
  for (uint32_t d : divisors) {
    FastDivmod f(d);
    for (int i = 0; i < 20000; ++i) {
      const uint32_t n = i < 64 ? 0xffffffffu - static_cast<uint32_t>(i) : static_cast<uint32_t>(rng());
      if (f.div_wide(n) != n / d) {
        test::fail(__FILE__, __LINE__, "div_wide " + std::to_string(n) + " / " + std::to_string(d));
        break;
      }
    }
    CHECK_EQ(f.div_wide(0x80000000u), 0x80000000u / d);
  }
}

namespace {
// The finite values of an fp8 format, built from its definition alone: code
// -> value for every positive code that is not NaN or infinite.
struct Fp8Table {
  std::vector<double> value;
  std::vector<uint8_t> code;
  Fp8Table(int mbits, int bias, int max_code) {
    for (int c = 0; c <= max_code; ++c) {
      const int exp = c >> mbits, man = c & ((1 << mbits) - 1);
      value.push_back(exp == 0 ? std::ldexp(man, 1 - bias - mbits)
                               : std::ldexp((1 << mbits) + man, exp - bias - mbits));
      code.push_back(static_cast<uint8_t>(c));
    }
  }
  // nearest value, ties to the even code; past the largest, the largest
  uint8_t expect(double a) const {
    if (a >= value.back()) return code.back();
    const size_t hi = static_cast<size_t>(std::upper_bound(value.begin(), value.end(), a) - value.begin());
    const size_t lo = hi - 1;
    const double dl = a - value[lo], dh = value[hi] - a;
    if (dl < dh) return code[lo];
    if (dh < dl) return code[hi];
    return code[lo] % 2 == 0 ? code[lo] : code[hi];
  }
};
}  // namespace

TEST_CASE("float -> fp8: nearest even, saturated, against a table built from the formats' definitions") {
  const Fp8Table e4m3(3, 7, 0x7e), e5m2(2, 15, 0x7b);
  // Every float32 whose low ten mantissa bits are one of these: every rounding
  // boundary of both formats (they need at most four mantissa bits) and the
  // floats either side of it, at every exponent, both signs.
  const uint32_t lows[] = {0x000, 0x001, 0x1ff, 0x200, 0x201, 0x3fe, 0x3ff};
  int64_t checked = 0;
  for (uint32_t hi = 0; hi < (1u << 22); ++hi) {  // sign, exponent and the top 13 mantissa bits
    for (uint32_t low : lows) {
      const uint32_t bits = (hi << 10) | low;
      float x;
      std::memcpy(&x, &bits, 4);
      if (std::isnan(x)) continue;
      const double a = std::fabs(static_cast<double>(x));
      const uint8_t sign = std::signbit(x) ? 0x80 : 0;
      for (int kind : {1, 2}) {
        const Fp8Table& t = kind == 1 ? e4m3 : e5m2;
        const uint8_t want = sign | t.expect(a), got = attnprep::cpu::float_to_fp8(x, kind);
        if (got != want) {
          test::fail(__FILE__, __LINE__,
                     "fp8 kind " + std::to_string(kind) + " of bits " + std::to_string(bits) + ": got " +
                         std::to_string(got) + ", want " + std::to_string(want));
          return;
        }
        ++checked;
      }
    }
  }
  CHECK(checked > 50000000);
  CHECK_EQ(attnprep::cpu::float_to_fp8(std::nanf(""), 1) & 0x7f, 0x7f);
  CHECK_EQ(attnprep::cpu::float_to_fp8(INFINITY, 1), uint8_t{0x7e});  // saturated, not NaN
  CHECK_EQ(attnprep::cpu::float_to_fp8(-INFINITY, 2), uint8_t{0xfb});
  CHECK_EQ(attnprep::cpu::float_to_fp8(464.0f, 1), uint8_t{0x7e});  // past 448: saturates
  CHECK_EQ(attnprep::cpu::float_to_fp8(1.0f, 1), uint8_t{0x38});
}

TEST_MAIN()
