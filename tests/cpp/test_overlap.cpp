// The overlap arithmetic behind the "must not overlap" checks, against a
// brute-force oracle that lists every byte each view addresses, and the copy
// kernel's launch geometry.
#include <random>
#include <set>

#include "check.h"
#include "core/overlap.h"
#include "core/strided_copy.h"
#include "tensor_builder.h"

using namespace attnprep::core;
using test::make;

namespace {

// A view of `base` (an address) with the given shape and strides (elements).
TensorArg view(uintptr_t base, std::initializer_list<int64_t> shape, std::initializer_list<int64_t> strides,
               DType dt = DType::BFloat16) {
  TensorArg t = make(shape, dt, {DeviceType::CUDA, 0}, strides);
  t.data = reinterpret_cast<void*>(base);
  return t;
}

std::set<uintptr_t> bytes_of(const TensorArg& t, bool* repeats = nullptr) {
  std::set<uintptr_t> out;
  if (t.numel() == 0) return out;
  int64_t idx[kMaxDims] = {};
  if (repeats) *repeats = false;
  for (;;) {
    int64_t off = 0;
    for (int d = 0; d < t.ndim; ++d) off += idx[d] * t.strides[d];
    for (int b = 0; b < t.itemsize; ++b) {
      const bool fresh = out.insert(reinterpret_cast<uintptr_t>(t.data) + off * t.itemsize + b).second;
      if (!fresh && repeats) *repeats = true;
    }
    int d = t.ndim - 1;
    while (d >= 0 && ++idx[d] == t.shape[d]) idx[d--] = 0;
    if (d < 0) break;
  }
  return out;
}

bool brute_overlap(const TensorArg& a, const TensorArg& b) {
  const auto x = bytes_of(a), y = bytes_of(b);
  for (uintptr_t p : x)
    if (y.count(p)) return true;
  return false;
}

}  // namespace

TEST_CASE("views of one buffer: split projection, combined cache halves, slices") {
  const uintptr_t B = uintptr_t{1} << 30;
  // q, k, v slices of one [T, (8 + 2 + 2) * 64] projection
  const TensorArg q = view(B, {5, 8, 64}, {768, 64, 1}), k = view(B + 2 * 512, {5, 2, 64}, {768, 64, 1}),
                  v = view(B + 2 * 640, {5, 2, 64}, {768, 64, 1});
  CHECK(!may_overlap(q, k) && !may_overlap(k, v) && !may_overlap(q, v));
  CHECK(may_overlap(q, view(B + 2 * 448, {5, 2, 64}, {768, 64, 1})));  // k shifted one head into q
  // k and v halves of one [pages, 2, page, heads, D] cache
  const TensorArg kc = view(B, {4, 16, 2, 64}, {2 * 2048, 128, 64, 1}),
                  vc = view(B + 2 * 2048, {4, 16, 2, 64}, {2 * 2048, 128, 64, 1});
  CHECK(!may_overlap(kc, vc));
  CHECK(may_overlap(kc, kc));
  // one element of overlap at the very end
  CHECK(may_overlap(view(B, {4, 4}, {4, 1}), view(B + 2 * 15, {1, 1}, {1, 1})));
  CHECK(!may_overlap(view(B, {4, 4}, {4, 1}), view(B + 2 * 16, {1, 1}, {1, 1})));
  // half an element (a misaligned view) is overlap too
  CHECK(may_overlap(view(B, {4}, {1}, DType::Float32), view(B + 14, {1}, {1}, DType::Float32)));
  // empty tensors and tensors without an address never overlap
  CHECK(!may_overlap(view(B, {0, 4}, {4, 1}), view(B, {4, 4}, {4, 1})));
  TensorArg meta = view(B, {4, 4}, {4, 1});
  meta.has_address = false;
  CHECK(!may_overlap(meta, meta));
}

TEST_CASE("may_overlap equals the brute-force oracle on random small views") {
  std::mt19937 rng(7);
  int checked = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    auto rand_view = [&](uintptr_t base) {
      const int nd = 1 + rng() % 3;
      TensorArg t = make({1}, rng() % 2 ? DType::BFloat16 : DType::Float32);
      t.ndim = nd;
      for (int d = 0; d < nd; ++d) {
        t.shape[d] = 1 + rng() % 4;
        t.strides[d] = static_cast<int64_t>(rng() % 9);
      }
      if (rng() % 2) t.strides[nd - 1] = 1;
      t.data = reinterpret_cast<void*>(base + rng() % 24);
      return t;
    };
    const uintptr_t B = uintptr_t{1} << 20;
    const TensorArg a = rand_view(B), b = rand_view(B);
    const bool want = brute_overlap(a, b);
    if (may_overlap(a, b) != want) {
      test::fail(__FILE__, __LINE__, "iteration " + std::to_string(iter) + ": expected " + std::to_string(want));
      break;
    }
    ++checked;
  }
  CHECK_EQ(checked, 3000);
}

TEST_CASE("has_internal_overlap: never misses a repeated element; ordinary layouts pass") {
  const uintptr_t B = uintptr_t{1} << 30;
  CHECK(!has_internal_overlap(view(B, {4, 3, 8}, {24, 8, 1})));
  CHECK(!has_internal_overlap(view(B, {4, 3, 8}, {8, 32, 1})));               // permuted
  CHECK(!has_internal_overlap(view(B, {16, 2, 64}, {384, 64, 1})));           // row-strided pool
  CHECK(!has_internal_overlap(view(B, {4, 16, 2, 64}, {4096, 128, 64, 1})));  // a combined cache's half
  CHECK(has_internal_overlap(view(B, {4, 3, 8}, {0, 8, 1})));                 // expanded
  CHECK(has_internal_overlap(view(B, {4, 8}, {4, 1})));                       // rows that overlap
  std::mt19937 rng(11);
  for (int iter = 0; iter < 3000; ++iter) {
    TensorArg t = make({1});
    t.ndim = 1 + rng() % 3;
    for (int d = 0; d < t.ndim; ++d) {
      t.shape[d] = 1 + rng() % 4;
      t.strides[d] = static_cast<int64_t>(rng() % 12);
    }
    t.data = reinterpret_cast<void*>(B);
    bool repeats = false;
    bytes_of(t, &repeats);
    if (repeats && !has_internal_overlap(t)) {
      test::fail(__FILE__, __LINE__, "missed a repeated element at iteration " + std::to_string(iter));
      break;
    }
  }
}

TEST_CASE("copy launch geometry: the policy, every vector covered, small copies on y") {
  CopyJob job;
  job.src = reinterpret_cast<void*>(uintptr_t{1} << 20);
  job.dst = reinterpret_cast<void*>(uintptr_t{1} << 30);
  job.itemsize = 2;
  job.src_elem_stride = 2;
  job.row_bytes = 256;
  auto plan_for = [&](int64_t rows, int njobs) {
    CopyJob jobs[3] = {job, job, job};
    for (auto& j : jobs) {
      j.dims[3] = rows;
      j.src_stride[3] = 256;
      j.dst_stride[3] = 256;
    }
    return plan_strided_copy(jobs, njobs);
  };
  const StridedCopyPlan small = plan_for(65, 3);  // 65 rows x 16 vectors x 3 jobs
  const CopyCudaLaunch s = plan_copy_cuda_launch(small);
  CHECK(s.small);
  CHECK_EQ(s.threads, CopyCudaPolicy::small_threads);
  CHECK_EQ(s.grid_y, int64_t{3});
  CHECK(s.grid_x * s.threads * s.vectors_per_thread >= small.max_total);
  const StridedCopyPlan large = plan_for(int64_t{1} << 16, 3);
  const CopyCudaLaunch l = plan_copy_cuda_launch(large);
  CHECK(!l.small);
  CHECK_EQ(l.threads, CopyCudaPolicy::large_threads);
  CHECK_EQ(l.vectors_per_thread, CopyCudaPolicy::large_vectors_per_thread);
  CHECK_EQ(l.grid_y, int64_t{1});
  CHECK_EQ(l.grid_x % 3, int64_t{0});  // blocks alternate between the jobs
  CHECK((l.grid_x / 3) * l.threads * l.vectors_per_thread >= large.max_total);
  CHECK_EQ(plan_copy_cuda_launch(plan_for(0, 3)).grid_x, int64_t{0});  // nothing to launch
}

TEST_MAIN()
