// usp_merge_heads: checks and messages, and the copy plan executed on the
// host against the CPU reference for odd sizes and arbitrary strides.
#include <cstring>

#include "check.h"
#include "core/errors.h"
#include "core/usp_merge_heads.h"
#include "cpu/layout_reference.h"
#include "plan_executor.h"
#include "tensor_builder.h"

using namespace attnprep::core;
using test::make;

namespace {
const Device cuda0{DeviceType::CUDA, 0};
void check(const TensorArg& x) {
  int64_t shape[5];
  check_usp_merge_heads(x, shape);
}
}  // namespace

TEST_CASE("checks: 5-D, CUDA, dtype") {
  CHECK_THROWS_MSG(ValueError, check(make({2, 3, 4, 5})),
                   "usp_merge_heads expects x to be 5-D [W, S, B, h_local, D], got torch.Size([2, 3, 4, 5])");
  CHECK_THROWS_MSG(ValueError, check(make({2, 3, 1, 4, 8}, DType::Float16, {DeviceType::CPU, 0})),
                   "usp_merge_heads expects a CUDA tensor");
  CHECK_THROWS_MSG(ValueError, check(make({2, 3, 1, 4, 8}, DType::Float64)),
                   "Unsupported usp_merge_heads dtype: torch.float64");
  CHECK_THROWS_MSG(ValueError, check(make({2, 3, 1, 4, 8}, DType::Float8E4M3FN)),
                   "Unsupported usp_merge_heads dtype: torch.float8_e4m3fn");
  CHECK_THROWS_MSG(ValueError, check(make({2, 3, 1, 4, 8}, DType::Int32)),
                   "Unsupported usp_merge_heads dtype: torch.int32");
  for (DType d : {DType::Float16, DType::BFloat16, DType::Float32}) check(make({2, 3, 1, 4, 8}, d));
  // an expanded x whose output would pass 2^63 - 1 bytes (2^62 float32s); 2^61 bfloat16s fit
  CHECK_THROWS_MSG(ValueError,
                   check(make({int64_t{1} << 31, int64_t{1} << 31, 1, 1, 1}, DType::Float32, cuda0, {0, 0, 1, 1, 1})),
                   "x is too large: the output would exceed 2^63 - 1 bytes");
  check(make({int64_t{1} << 31, int64_t{1} << 30, 1, 1, 1}, DType::BFloat16, cuda0, {0, 0, 1, 1, 1}));
  int64_t shape[5];
  check_usp_merge_heads(make({2, 3, 5, 4, 8}), shape);
  CHECK(shape[0] == 5 && shape[1] == 3 && shape[2] == 2 && shape[3] == 4 && shape[4] == 8);
}

namespace {
void merge_matches(std::initializer_list<int64_t> shape, std::initializer_list<int64_t> strides, DType dt,
                   uint32_t seed) {
  TensorArg x = make(shape, dt, cuda0, strides);
  test::HostBuffer bx;
  bx.attach(x, seed);
  int64_t os[5];
  check_usp_merge_heads(x, os);
  TensorArg got = make({os[0], os[1], os[2], os[3], os[4]}, dt), want = got;
  test::HostBuffer bg, bw;
  bg.attach(got, seed + 1);
  bw.attach(want, seed + 2);
  test::execute_on_host(plan_usp_merge_heads(x, got));
  attnprep::cpu::usp_merge_heads_reference(x, want);
  if (std::memcmp(got.data, want.data, static_cast<size_t>(got.numel() * got.itemsize)) != 0)
    test::fail(__FILE__, __LINE__, "merge mismatch for " + shape_str(x));
}
}  // namespace

TEST_CASE("plan + reference: contiguous, permuted, last-dim strided, odd sizes") {
  merge_matches({2, 3, 1, 4, 8}, {}, DType::BFloat16, 1);
  merge_matches({3, 17, 2, 5, 65}, {}, DType::Float16, 2);
  merge_matches({4, 7, 3, 2, 16}, {}, DType::Float32, 3);
  // x = y.permute(...) of a [S, B, W, h, D] buffer: strides all over the place
  merge_matches({4, 7, 3, 2, 16}, {2 * 16, 3 * 4 * 2 * 16, 4 * 2 * 16, 16, 1}, DType::Float32, 4);
  // last dimension strided (every other element)
  merge_matches({2, 5, 2, 3, 9}, {5 * 2 * 3 * 18, 2 * 3 * 18, 3 * 18, 18, 2}, DType::BFloat16, 5);
  merge_matches({1, 1, 1, 1, 1}, {}, DType::Float16, 6);
  merge_matches({2, 0, 3, 4, 8}, {}, DType::Float16, 7);
}

TEST_MAIN()
