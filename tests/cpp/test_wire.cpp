// The fp8 wire's index arithmetic (core/wire.h), executed on the host as the
// CUDA kernel runs it: for the layer's pack plans (MHA, GQA split and
// replicated) and for strided views, every wire value byte and every scale is
// written exactly once, padding never, and the map stays inside the buffer.
#include <vector>

#include "check.h"
#include "core/pack_qkv.h"
#include "core/wire.h"
#include "tensor_builder.h"

using namespace attnprep::core;
using test::make;

namespace {

// Runs the kernel's walk over `plan` (16-byte plain vectors) and counts the
// writes per wire byte, as the quantizing direction makes them.
std::vector<int> wire_writes(const StridedCopyPlan& plan, const WireMap& m, int64_t rows, int64_t itemsize) {
  std::vector<int> writes(static_cast<size_t>(rows * m.row_bytes), 0);
  const int64_t per_vector = 16 / itemsize;  // fp8 bytes a vector's lane writes
  for (int j = 0; j < plan.njobs; ++j) {
    const CopyJobPlan& job = plan.jobs[j];
    for (int64_t i = 0; i < job.total; ++i) {
      int64_t from, to, value, scale, slot;
      copy_offsets<true>(job, i, 16, from, to);
      const uint64_t plain = static_cast<uint64_t>(job.dst + to - m.plain_base);
      wire_offsets(m, plain, value, scale, slot);
      for (int64_t b = 0; b < per_vector; ++b) writes.at(static_cast<size_t>(value + b)) += 1;
      if ((plain & ((uint64_t{1} << m.block_shift) - 1)) == 0)
        for (int64_t b = 0; b < 4; ++b) writes.at(static_cast<size_t>(scale + b)) += 1;
    }
  }
  return writes;
}

// Every value and scale byte once, every padding byte never.
void check_coverage(const std::vector<int>& writes, int64_t rows, int64_t blocks, int64_t head_size) {
  const int64_t row_bytes = wire_row_bytes(blocks, head_size), used = blocks * (head_size + 4);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < row_bytes; ++b) {
      const int want = b < used ? 1 : 0;
      if (writes[static_cast<size_t>(r * row_bytes + b)] != want) {
        test::fail(__FILE__, __LINE__,
                   "wire byte " + std::to_string(b) + " of row " + std::to_string(r) + " written " +
                       std::to_string(writes[r * row_bytes + b]) + " times");
        return;
      }
    }
}

void pack_covers(int64_t world, int64_t rows, int64_t heads, int64_t kv, int64_t dim) {
  TensorArg q = make({rows, heads, dim}), k = make({rows, kv, dim}), v = make({rows, kv, dim});
  TensorArg plain = q;
  plain.data = reinterpret_cast<void*>(int64_t{1} << 40);  // only the base address is used
  StridedCopyPlan plan;
  int64_t blocks;
  if (kv == heads) {
    const PackQkvShape s = check_pack_qkv_inputs(q, k, v, world);
    blocks = 3 * s.local_heads;
    plan = plan_pack_qkv(s, q, k, v, plain);
  } else {
    const PackGqaShape s = check_pack_qkv_gqa(q, k, v, world, 1);
    blocks = s.out_shape[3] / dim;
    plan = plan_pack_qkv_gqa(s, q, k, v, plain);
  }
  CHECK(wire_kernel_applies(plan, DType::BFloat16, 2, dim, world * rows * blocks));
  const WireMap m = make_wire_map(plain.data, nullptr, blocks, dim, 2);
  check_coverage(wire_writes(plan, m, world * rows, 2), world * rows, blocks, dim);
}

}  // namespace

TEST_CASE("wire rows: values, scales, padding to 16 bytes") {
  CHECK_EQ(wire_row_bytes(3, 128), int64_t{3 * 128 + 12 + 4});
  CHECK_EQ(wire_row_bytes(4, 64), int64_t{4 * 64 + 16});
  CHECK_EQ(wire_row_bytes(1, 8), int64_t{16});
  CHECK_EQ(wire_row_bytes(0, 128), int64_t{0});
}

TEST_CASE("pack plans: every wire byte written once (MHA, GQA split, GQA replicated, odd sizes)") {
  pack_covers(2, 17, 8, 8, 128);
  pack_covers(3, 5, 6, 6, 64);
  pack_covers(1, 1, 2, 2, 256);
  pack_covers(2, 9, 8, 4, 128);  // kv split across ranks
  pack_covers(4, 7, 8, 2, 64);   // kv head replicated
  pack_covers(2, 65, 4, 1, 16);  // one block is one unit
}

TEST_CASE("strided views: a transposed attention output, quantized and dequantized") {
  for (bool to_plain : {true, false}) {
    // [W, rows, h, D] view of a [h, W * rows, D] tensor
    const int64_t w = 3, rows = 17, h = 5, dim = 64;
    TensorArg x = make({w, rows, h, dim}, DType::Float16, {DeviceType::CUDA, 0}, {rows * dim, dim, w * rows * dim, 1});
    const void* plain_base = reinterpret_cast<void*>(int64_t{1} << 41);
    const StridedCopyPlan plan = plan_wire_view(x, plain_base, to_plain);
    CHECK(wire_kernel_applies(plan, DType::Float16, 2, dim, w * rows * h));
    const WireMap m = make_wire_map(plain_base, nullptr, h, dim, 2);
    if (to_plain) {
      check_coverage(wire_writes(plan, m, w * rows, 2), w * rows, h, dim);
    } else {  // the dequantizing walk reads each value byte once and writes each view element once
      std::vector<int> reads(static_cast<size_t>(w * rows * m.row_bytes), 0);
      const CopyJobPlan& job = plan.jobs[0];
      for (int64_t i = 0; i < job.total; ++i) {
        int64_t from, to, value, scale, slot;
        copy_offsets<true>(job, i, 16, from, to);
        wire_offsets(m, static_cast<uint64_t>(job.src + from - m.plain_base), value, scale, slot);
        for (int b = 0; b < 8; ++b) reads.at(static_cast<size_t>(value + b)) += 1;
        CHECK(scale >= 0 && scale + 4 <= w * rows * m.row_bytes);
        CHECK(slot >= 0 && slot < h);
      }
      int64_t once = 0;
      for (int r : reads) once += r == 1;
      CHECK_EQ(once, w * rows * h * dim);
    }
  }
}

TEST_CASE("where the kernels apply") {
  const TensorArg x = make({2, 3, 4, 128});
  const void* base = reinterpret_cast<void*>(int64_t{1} << 41);
  const StridedCopyPlan plan = plan_wire_view(x, base, true);
  CHECK(wire_kernel_applies(plan, DType::BFloat16, 2, 128, 24));
  CHECK(wire_kernel_applies(plan, DType::Float32, 4, 128, 24));   // 512-byte blocks
  CHECK(wire_kernel_applies(plan, DType::Float32, 4, 256, 24));   // 1024: 32 lanes of 32 bytes
  CHECK(!wire_kernel_applies(plan, DType::Float32, 4, 512, 24));  // 2048: more lanes than a warp
  CHECK(!wire_kernel_applies(plan, DType::BFloat16, 2, 96, 24));  // 192 bytes: not a power of two
  CHECK(!wire_kernel_applies(plan, DType::BFloat16, 2, 8, 24));   // 16 bytes: under one unit
  CHECK(!wire_kernel_applies(plan, DType::Float64, 8, 16, 24));
  CHECK(!wire_kernel_applies(plan, DType::BFloat16, 2, 128, int64_t{1} << 31));
  const TensorArg strided =
      make({2, 3, 4, 128}, DType::BFloat16, {DeviceType::CUDA, 0}, {3 * 4 * 256, 4 * 256, 256, 2});
  CHECK(!wire_kernel_applies(plan_wire_view(strided, base, true), DType::BFloat16, 2, 128, 24));
}

TEST_MAIN()
