// Core utilities: shape rendering, dtype names, contiguity, fast division.
#include <random>

#include "check.h"
#include "core/fast_divmod.h"
#include "core/tensor.h"
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
}

TEST_CASE("is_contiguous follows torch") {
  CHECK(test::make({2, 3, 4}).is_contiguous());
  CHECK(!test::make({2, 3, 4}, DType::Float32, {}, {12, 1, 3}).is_contiguous());
  CHECK(test::make({2, 1, 4}, DType::Float32, {}, {4, 99, 1}).is_contiguous());  // size-1 dim
  CHECK(test::make({2, 0, 4}, DType::Float32, {}, {7, 5, 3}).is_contiguous());   // empty
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

TEST_MAIN()
