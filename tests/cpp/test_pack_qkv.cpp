// pack_qkv_destination_major: the eight documented checks in order, with every
// case CI cannot build from real tensors (two CUDA devices, mixed dtypes on
// CUDA), and the copy plan executed on the host against the CPU reference.
#include <cstring>

#include "check.h"
#include "core/errors.h"
#include "core/pack_qkv.h"
#include "cpu/layout_reference.h"
#include "plan_executor.h"
#include "tensor_builder.h"

using namespace attnprep::core;
using test::make;

namespace {
const Device cuda0{DeviceType::CUDA, 0}, cuda1{DeviceType::CUDA, 1}, cpu{DeviceType::CPU, 0};
const char* kShape = "q, k, and v must have the same 3D shape";
const char* kCuda = "q, k, and v must be CUDA tensors";
const char* kSame = "q, k, and v must have the same device and dtype";
const char* kUnit = "q, k, and v must be contiguous in head_size";
const char* kWorld = "world_size must be positive and divide global_heads";
const char* kOut = "out must be a contiguous tensor with the expected shape, device, and dtype";

void inputs(const TensorArg& q, const TensorArg& k, const TensorArg& v, int64_t w) {
  check_pack_qkv_inputs(q, k, v, w);
}
void with_out(const TensorArg& q, const TensorArg& out, int64_t w) {
  check_pack_qkv_out(check_pack_qkv_inputs(q, q, q, w), q, q, q, out);
}
}  // namespace

TEST_CASE("check 1: same 3D shape") {
  auto q = make({4, 8, 64});
  CHECK_THROWS_MSG(ValueError, inputs(make({4, 8}), make({4, 8}), make({4, 8}), 2), kShape);
  CHECK_THROWS_MSG(ValueError, inputs(make({1, 4, 8, 64}), make({1, 4, 8, 64}), make({1, 4, 8, 64}), 2), kShape);
  CHECK_THROWS_MSG(ValueError, inputs(q, make({4, 8, 32}), q, 2), kShape);
  CHECK_THROWS_MSG(ValueError, inputs(q, q, make({5, 8, 64}), 2), kShape);
  // shape wins over every later check
  CHECK_THROWS_MSG(ValueError, inputs(make({4, 8}, DType::Float32, cpu), q, q, 0), kShape);
}

TEST_CASE("check 2: CUDA tensors") {
  auto q = make({4, 8, 64});
  auto c = make({4, 8, 64}, DType::BFloat16, cpu);
  auto mps = make({4, 8, 64}, DType::BFloat16, {DeviceType::MPS, 0});
  CHECK_THROWS_MSG(ValueError, inputs(c, q, q, 2), kCuda);
  CHECK_THROWS_MSG(ValueError, inputs(q, c, q, 2), kCuda);
  CHECK_THROWS_MSG(ValueError, inputs(q, q, mps, 2), kCuda);
  CHECK_THROWS_MSG(ValueError, inputs(c, c, make({4, 8, 64}, DType::Float16, cpu), 0), kCuda);
}

TEST_CASE("check 3: same device and dtype (two GPUs, mixed dtypes)") {
  auto q = make({4, 8, 64});
  CHECK_THROWS_MSG(ValueError, inputs(q, make({4, 8, 64}, DType::BFloat16, cuda1), q, 2), kSame);
  CHECK_THROWS_MSG(ValueError, inputs(q, q, make({4, 8, 64}, DType::Float16, cuda0), 2), kSame);
  CHECK_THROWS_MSG(ValueError,
                   inputs(make({4, 8, 64}, DType::Float8E4M3FN), make({4, 8, 64}, DType::Float8E5M2),
                          make({4, 8, 64}, DType::Float8E4M3FN), 0),
                   kSame);
}

TEST_CASE("check 4: unit stride in head_size") {
  auto q = make({4, 8, 64});
  auto strided = make({4, 8, 64}, DType::BFloat16, cuda0, {1024, 128, 2});
  CHECK_THROWS_MSG(ValueError, inputs(q, strided, q, 2), kUnit);
  CHECK_THROWS_MSG(ValueError, inputs(q, q, strided, 3), kUnit);  // before world_size
  // row and head strides are free
  inputs(make({4, 8, 64}, DType::BFloat16, cuda0, {3 * 8 * 64, 64, 1}), q, q, 2);
}

TEST_CASE("check 5: world_size") {
  auto q = make({4, 8, 64});
  CHECK_THROWS_MSG(ValueError, inputs(q, q, q, 0), kWorld);
  CHECK_THROWS_MSG(ValueError, inputs(q, q, q, -2), kWorld);
  CHECK_THROWS_MSG(ValueError, inputs(q, q, q, 3), kWorld);
  CHECK_THROWS_MSG(ValueError, inputs(q, q, q, 16), kWorld);
  for (int w : {1, 2, 4, 8}) inputs(q, q, q, w);
}

TEST_CASE("check 6: out") {
  auto q = make({4, 8, 64});
  with_out(q, make({2, 4, 4, 192}), 2);
  CHECK_THROWS_MSG(ValueError, with_out(q, make({2, 4, 4, 191}), 2), kOut);
  CHECK_THROWS_MSG(ValueError, with_out(q, make({4, 4, 192}), 2), kOut);
  CHECK_THROWS_MSG(ValueError, with_out(q, make({2, 4, 4, 192}, DType::Float16), 2), kOut);
  CHECK_THROWS_MSG(ValueError, with_out(q, make({2, 4, 4, 192}, DType::BFloat16, cuda1), 2), kOut);
  CHECK_THROWS_MSG(ValueError, with_out(q, make({2, 4, 4, 192}, DType::BFloat16, cpu), 2), kOut);
  CHECK_THROWS_MSG(ValueError, with_out(q, make({2, 4, 4, 192}, DType::BFloat16, cuda0, {1, 2, 8, 32}), 2), kOut);
}

TEST_CASE("check 8: an output past 2^63 - 1 bytes (empty or expanded inputs); with out, check 6") {
  const char* too_large = "q, k, and v are too large: the output would exceed 2^63 - 1 bytes";
  const TensorArg empty = make({0, 1, int64_t{1} << 62});  // 3 * head_size past int64
  const TensorArg expanded = make({int64_t{1} << 56, 4, 8}, DType::Float32, cuda0, {0, 8, 1});
  for (const TensorArg& q : {empty, expanded}) {
    const PackQkvShape s = check_pack_qkv_inputs(q, q, q, 1);
    CHECK_THROWS_MSG(ValueError, check_pack_qkv_output_size(s), too_large);
    for (int d = 0; d < 4; ++d) CHECK_EQ(s.out_shape[d], int64_t{-1});  // no tensor has it
    CHECK_THROWS_MSG(ValueError, with_out(q, make({1, 1, 1, 24}, q.dtype), 1), kOut);
  }
  // an expanded pack that fits (6 * 2^55 elements of 2 bytes), and an empty one past it (3 * 2^61 of 2 bytes)
  check_pack_qkv_output_size(check_pack_qkv_inputs(make({int64_t{1} << 55, 1, 2}, DType::BFloat16, cuda0, {0, 0, 1}),
                                                   make({int64_t{1} << 55, 1, 2}, DType::BFloat16, cuda0, {0, 0, 1}),
                                                   make({int64_t{1} << 55, 1, 2}, DType::BFloat16, cuda0, {0, 0, 1}),
                                                   1));
  const TensorArg big_empty = make({0, 1, int64_t{1} << 61});
  CHECK_THROWS_MSG(ValueError, check_pack_qkv_output_size(check_pack_qkv_inputs(big_empty, big_empty, big_empty, 1)),
                   too_large);
}

namespace {
// Packs through the plan (host execution) and through the reference; the
// bytes must match everywhere, including every output byte being written.
void pack_matches(int64_t rows, int64_t heads, int64_t dim, int64_t world, DType dtype, bool fused,
                  int64_t misalign_elems, uint32_t seed) {
  const int es = test::itemsize_of(dtype);
  TensorArg q, k, v;
  test::HostBuffer bq, bk, bv;
  if (fused) {  // slices of one [rows, 3 * heads * dim] projection
    TensorArg all = make({rows, 3 * heads * dim}, dtype);
    bq.attach(all, seed, misalign_elems * es);
    q = make({rows, heads, dim}, dtype, cuda0, {3 * heads * dim, dim, 1});
    k = q;
    v = q;
    q.data = all.data;
    k.data = static_cast<unsigned char*>(all.data) + heads * dim * es;
    v.data = static_cast<unsigned char*>(all.data) + 2 * heads * dim * es;
  } else {
    q = make({rows, heads, dim}, dtype);
    k = make({rows, heads, dim}, dtype, cuda0, {heads * dim * 2, dim, 1});  // every other row
    v = make({rows, heads, dim}, dtype);
    bq.attach(q, seed, misalign_elems * es);
    bk.attach(k, seed + 1);
    bv.attach(v, seed + 2);
  }
  auto shape = check_pack_qkv_inputs(q, k, v, world);
  TensorArg got = make({world, rows, heads / world, 3 * dim}, dtype);
  TensorArg want = got;
  test::HostBuffer bg, bw;
  bg.attach(got, 7);  // poisoned: random bytes
  bw.attach(want, 8);
  auto plan = plan_pack_qkv(shape, q, k, v, got);
  test::execute_on_host(plan);
  attnprep::cpu::pack_qkv_reference(q, k, v, world, want);
  const size_t n = static_cast<size_t>(got.numel() * es);
  const std::string what = "rows=" + std::to_string(rows) + " heads=" + std::to_string(heads) +
                           " dim=" + std::to_string(dim) + " world=" + std::to_string(world);
  if (std::memcmp(got.data, want.data, n) != 0)
    test::fail(__FILE__, __LINE__, "pack mismatch " + what + " vec=" + std::to_string(plan.vec_bytes));
  // the flat pass where it applies, walked in both orders, each over a fresh poisoned output
  PackFlatPlan flat;
  const bool aligned16 = (dim * es) % 16 == 0 && misalign_elems == 0;
  if (plan_pack_flat(shape, q, k, v, got, flat) != (aligned16 && n > 0))
    test::fail(__FILE__, __LINE__, "flat plan " + what);
  if (aligned16 && n > 0) {
    for (bool input_order : {false, true}) {
      // the divisor that splits (destination, token) is the walk's choice
      flat.by_inner = FastDivmod(static_cast<uint32_t>(input_order ? world : rows));
      for (auto& b : bg.bytes) b = 0xA5;  // poisoned again
      for (int64_t i = 0; i < flat.total; ++i) {
        int which;
        int64_t from;
        uint32_t to;
        if (input_order)
          pack_flat_step<true>(flat, static_cast<uint32_t>(i), which, from, to);
        else
          pack_flat_step<false>(flat, static_cast<uint32_t>(i), which, from, to);
        std::memcpy(flat.out + int64_t{to} * 16, flat.src[which] + from, 16);
      }
      if (std::memcmp(got.data, want.data, n) != 0)
        test::fail(__FILE__, __LINE__, "flat pack mismatch " + what + (input_order ? " input order" : ""));
    }
  }
}
}  // namespace

TEST_CASE("plan + reference: bit-exact over shapes, dtypes, strides, alignments") {
  uint32_t seed = 1;
  for (DType dt : {DType::BFloat16, DType::Float32, DType::Float8E4M3FN, DType::Float64})
    for (int64_t rows : {1, 17, 65})
      for (int64_t dim : {64, 80, 3})
        for (int64_t world : {1, 2, 4})
          for (bool fused : {false, true})
            for (int64_t mis : {0, 1}) pack_matches(rows, 8, dim, world, dt, fused, mis, seed++);
  pack_matches(5, 24, 128, 3, DType::Float16, true, 0, seed++);
  pack_matches(0, 8, 64, 2, DType::Float16, false, 0, seed++);  // empty
}

TEST_CASE("plan picks 16-byte vectors when everything is aligned, narrower otherwise") {
  auto q = make({4, 8, 128});
  auto out = make({2, 4, 4, 384});
  auto s = check_pack_qkv_inputs(q, q, q, 2);
  CHECK_EQ(plan_pack_qkv(s, q, q, q, out).vec_bytes, 16);
  auto odd = q;
  odd.data = static_cast<unsigned char*>(q.data) + 2;  // one bf16 element off
  CHECK_EQ(plan_pack_qkv(s, odd, q, q, out).vec_bytes, 2);
  auto q80 = make({4, 8, 36});  // 72-byte rows
  auto out80 = make({2, 4, 4, 108});
  auto s80 = check_pack_qkv_inputs(q80, q80, q80, 2);
  CHECK_EQ(plan_pack_qkv(s80, q80, q80, q80, out80).vec_bytes, 8);
  CHECK_EQ(plan_pack_qkv(s, q, q, q, out).index_bits, 32);
}

TEST_CASE("the flat path: packs of 16-byte rows under 2^31 vectors, small ones in output order") {
  auto q = make({65, 8, 128});
  auto out = make({8, 65, 1, 384});
  PackFlatPlan flat;
  CHECK(plan_pack_flat(check_pack_qkv_inputs(q, q, q, 8), q, q, q, out, flat));
  CHECK_EQ(flat.total, 8 * 65 * 3 * 16);
  CHECK_EQ(flat.rows, 65);
  CHECK_EQ(flat.by_inner.divisor, uint32_t{65});  // output order: (destination, token)
  auto odd = q;
  odd.data = static_cast<unsigned char*>(q.data) + 2;  // one bf16 element off
  CHECK(!plan_pack_flat(check_pack_qkv_inputs(q, q, q, 8), odd, q, q, out, flat));
  auto q72 = make({4, 8, 36});  // 72-byte rows
  auto out72 = make({2, 4, 4, 108});
  CHECK(!plan_pack_flat(check_pack_qkv_inputs(q72, q72, q72, 2), q72, q72, q72, out72, flat));
  // strides past int32 bytes (rows of a view 2 GiB apart) take the engine
  auto far = q;
  far.strides[0] = (int64_t{1} << 30) + 1024;  // bf16 elements: 2^31 + 2048 bytes
  CHECK(!plan_pack_flat(check_pack_qkv_inputs(far, q, q, 8), far, q, q, out, flat));
  far.strides[0] = (int64_t{1} << 30) - 1024;  // just within
  CHECK(plan_pack_flat(check_pack_qkv_inputs(far, q, q, 8), far, q, q, out, flat));
  CHECK_EQ(flat.row_stride[0], int32_t{INT32_MAX - 2047});
  // output order up to the engine's small path, input order from there
  const int64_t rows = CopyCudaPolicy::small_below / (3 * 8 * 16) + 1;  // 8 destinations, 3 segments of 16 vectors
  auto big = make({rows, 8, 128});
  auto big_out = make({8, rows, 1, 384});
  CHECK(plan_pack_flat(check_pack_qkv_inputs(big, big, big, 8), big, big, big, big_out, flat));
  CHECK(pack_flat_walks_inputs(flat.total));
  CHECK_EQ(flat.by_inner.divisor, uint32_t{8});  // input order: (token, destination)
  auto below = make({rows - 1, 8, 128});
  auto below_out = make({8, rows - 1, 1, 384});
  CHECK(plan_pack_flat(check_pack_qkv_inputs(below, below, below, 8), below, below, below, below_out, flat));
  CHECK(!pack_flat_walks_inputs(flat.total));
  CHECK_EQ(flat.by_inner.divisor, uint32_t(rows - 1));
  CHECK(plan_copy_cuda_launch(plan_pack_qkv(check_pack_qkv_inputs(big, big, big, 8), big, big, big, big_out)).small ==
        false);
  CHECK(plan_copy_cuda_launch(
            plan_pack_qkv(check_pack_qkv_inputs(below, below, below, 8), below, below, below, below_out))
            .small);
  // under 2^31 vectors and no more (tensors never touched): 8 heads of 128
  // bf16 to 8 destinations are 384 vectors per token row
  const int64_t last = (int64_t{1} << 31) / 384;  // 2^31 - 128 vectors
  auto most = make({last, 8, 128});
  auto most_out = make({8, last, 1, 384});
  CHECK(plan_pack_flat(check_pack_qkv_inputs(most, most, most, 8), most, most, most, most_out, flat));
  CHECK_EQ(int64_t{flat.total}, last * 384);
  // the walk's last step reads the last vector of v and writes the output's last
  int which;
  int64_t from;
  uint32_t to;
  pack_flat_step<true>(flat, static_cast<uint32_t>(flat.total - 1), which, from, to);
  CHECK_EQ(which, 2);
  CHECK_EQ(from, (last * 8 * 128 - 8) * 2);
  CHECK_EQ(int64_t{to}, int64_t{flat.total} - 1);
  auto over = make({last + 1, 8, 128});
  auto over_out = make({8, last + 1, 1, 384});
  CHECK(!plan_pack_flat(check_pack_qkv_inputs(over, over, over, 8), over, over, over, over_out, flat));
}

TEST_CASE("plan switches to 64-bit indexing past 2^31 vectors") {
  auto q = make({1 << 22, 64, 128}, DType::Float32);  // 2^35 elements, never touched
  auto out = make({1, 1 << 22, 64, 384}, DType::Float32);
  auto s = check_pack_qkv_inputs(q, q, q, 1);
  auto plan = plan_pack_qkv(s, q, q, q, out);
  CHECK_EQ(plan.index_bits, 64);
  // the last vector of the last job lands on the last 16 bytes of out
  int64_t src, dst;
  const auto& job = plan.jobs[2];
  copy_offsets<false>(job, job.total - 1, plan.vec_bytes, src, dst);
  CHECK_EQ(static_cast<int64_t>(job.dst - static_cast<unsigned char*>(out.data)) + dst + 16, out.numel() * 4);
}

TEST_CASE("grouped pack (Ulysses): split and replicated kv heads, in chunks, bit-exact") {
  uint32_t seed = 100;
  // (rows, heads, kv_heads, world): kv divisible by world, and world divisible by kv
  const int64_t cases[][4] = {{5, 8, 4, 2}, {17, 8, 8, 4}, {3, 12, 2, 4}, {9, 12, 1, 3},
                              {4, 8, 2, 8}, {7, 6, 6, 1},  {6, 16, 8, 2}, {5, 24, 2, 2}};
  int chunked = 0;
  for (const auto& c : cases)
    for (int64_t chunks : {1, 2, 3, 4}) {
      const int64_t rows = c[0], heads = c[1], kv = c[2], world = c[3], dim = 24;
      const int64_t local_q = heads / world, local_kv = kv >= world ? kv / world : 1;
      if (local_q % chunks != 0 || (kv >= world && local_kv % chunks != 0)) continue;
      chunked += chunks > 1;
      TensorArg q = make({rows, heads, dim}, DType::Float16),
                k = make({rows, kv, dim}, DType::Float16, cuda0, {2 * kv * dim, dim, 1}),
                v = make({rows, kv, dim}, DType::Float16);
      test::HostBuffer bq, bk, bv;
      bq.attach(q, seed++);
      bk.attach(k, seed++);
      bv.attach(v, seed++);
      auto s = check_pack_qkv_gqa(q, k, v, world, chunks);
      TensorArg out = make({s.out_shape[0], s.out_shape[1], s.out_shape[2], s.out_shape[3]}, DType::Float16);
      test::HostBuffer bo;
      bo.attach(out, seed++);
      test::execute_on_host(plan_pack_qkv_gqa(s, q, k, v, out));
      // reference from the definition, element by element
      bool ok = true;
      const auto* o = static_cast<const uint16_t*>(out.data);
      auto at = [](const TensorArg& t, int64_t r, int64_t h, int64_t i) {
        return static_cast<const uint16_t*>(t.data)[r * t.strides[0] + h * t.strides[1] + i];
      };
      for (int64_t ch = 0; ch < chunks; ++ch)
        for (int64_t d = 0; d < world; ++d)
          for (int64_t r = 0; r < rows; ++r) {
            const uint16_t* row = o + ((ch * world + d) * rows + r) * s.out_shape[3];
            for (int64_t h = 0; h < s.chunk_q; ++h)
              for (int64_t i = 0; i < dim; ++i) ok &= row[h * dim + i] == at(q, r, d * local_q + ch * s.chunk_q + h, i);
            for (int64_t h = 0; h < s.chunk_kv; ++h) {
              const int64_t src = kv >= world ? d * local_kv + ch * s.chunk_kv + h : d * kv / world;
              for (int64_t i = 0; i < dim; ++i) {
                ok &= row[(s.chunk_q + h) * dim + i] == at(k, r, src, i);
                ok &= row[(s.chunk_q + s.chunk_kv + h) * dim + i] == at(v, r, src, i);
              }
            }
          }
      if (!ok)
        test::fail(__FILE__, __LINE__,
                   "grouped pack mismatch heads=" + std::to_string(heads) + " kv=" + std::to_string(kv) +
                       " world=" + std::to_string(world) + " chunks=" + std::to_string(chunks));
    }
  CHECK(chunked >= 6);
  const char* chunk_msg =
      "ulysses: chunks must be positive and divide each rank's q heads (and its kv heads when they "
      "are split)";
  CHECK_THROWS_MSG(ValueError, check_pack_qkv_gqa(make({4, 8, 8}), make({4, 8, 8}), make({4, 8, 8}), 2, 3), chunk_msg);
  CHECK_THROWS_MSG(ValueError, check_pack_qkv_gqa(make({4, 8, 8}), make({4, 4, 8}), make({4, 4, 8}), 2, 4), chunk_msg);
  CHECK_THROWS_MSG(ValueError, check_pack_qkv_gqa(make({4, 8, 8}), make({4, 8, 8}), make({4, 8, 8}), 2, 0), chunk_msg);
  check_pack_qkv_gqa(make({4, 8, 8}), make({4, 1, 8}), make({4, 1, 8}), 2, 4);  // one kv head, replicated per chunk
  CHECK_THROWS_MSG(ValueError, check_pack_qkv_gqa(make({4, 12, 8}), make({4, 6, 8}), make({4, 6, 8}), 4),
                   "ulysses: kv_heads must divide the q heads, and divide or be a multiple of world_size");
  CHECK_THROWS_MSG(ValueError, check_pack_qkv_gqa(make({4, 12, 8}), make({4, 4, 8}), make({4, 4, 8}), 5),
                   "ulysses: world_size must divide the number of q heads");
}

TEST_CASE("grouped pack of [S, B, H, D] views: rows (s, b), split and replicated kv heads, bit-exact") {
  uint32_t seed = 300;
  // (S, B, heads, kv_heads, world)
  const int64_t cases[][5] = {{5, 2, 8, 4, 2}, {3, 3, 12, 2, 4}, {4, 2, 8, 2, 8}, {7, 1, 6, 6, 1}, {1, 4, 4, 4, 2}};
  for (const auto& c : cases) {
    const int64_t S = c[0], B = c[1], heads = c[2], kv = c[3], world = c[4], dim = 16;
    const int64_t local_q = heads / world, local_kv = kv >= world ? kv / world : 1, n = local_q + 2 * local_kv;
    // [B, S, H, D] tensors seen as [S, B, H, D] (the batched layer's transposed inputs)
    TensorArg q = make({S, B, heads, dim}, DType::Float16, cuda0, {heads * dim, S * heads * dim, dim, 1}),
              k = make({S, B, kv, dim}, DType::Float16, cuda0, {kv * dim, S * kv * dim, dim, 1}),
              v = make({S, B, kv, dim}, DType::Float16, cuda0, {2 * kv * dim, S * 2 * kv * dim, dim, 1});
    test::HostBuffer bq, bk, bv;
    bq.attach(q, seed++);
    bk.attach(k, seed++);
    bv.attach(v, seed++);
    auto s = check_pack_qkv_gqa(q, k, v, world, 1);
    CHECK_EQ(s.out_shape[2], S * B);
    CHECK_EQ(s.out_shape[3], n * dim);
    TensorArg out = make({1, world, S * B, n * dim}, DType::Float16);
    test::HostBuffer bo;
    bo.attach(out, seed++);
    test::execute_on_host(plan_pack_qkv_gqa(s, q, k, v, out));
    bool ok = true;
    const auto* o = static_cast<const uint16_t*>(out.data);
    auto at = [](const TensorArg& t, int64_t r, int64_t b, int64_t h, int64_t i) {
      return static_cast<const uint16_t*>(t.data)[r * t.strides[0] + b * t.strides[1] + h * t.strides[2] + i];
    };
    for (int64_t d = 0; d < world; ++d)
      for (int64_t r = 0; r < S; ++r)
        for (int64_t b = 0; b < B; ++b) {
          const uint16_t* row = o + (d * S * B + r * B + b) * n * dim;
          for (int64_t h = 0; h < local_q; ++h)
            for (int64_t i = 0; i < dim; ++i) ok &= row[h * dim + i] == at(q, r, b, d * local_q + h, i);
          for (int64_t h = 0; h < local_kv; ++h) {
            const int64_t src = kv >= world ? d * local_kv + h : d * kv / world;
            for (int64_t i = 0; i < dim; ++i) {
              ok &= row[(local_q + h) * dim + i] == at(k, r, b, src, i);
              ok &= row[(local_q + local_kv + h) * dim + i] == at(v, r, b, src, i);
            }
          }
        }
    if (!ok)
      test::fail(__FILE__, __LINE__, "[S, B, H, D] pack mismatch S=" + std::to_string(S) + " B=" + std::to_string(B));
  }
  const char* msg = "ulysses: q must be [rows, heads, head_dim] and k, v [rows, kv_heads, head_dim]";
  const TensorArg q4 = make({4, 2, 8, 8}), k4 = make({4, 2, 4, 8});
  CHECK_THROWS_MSG(ValueError, check_pack_qkv_gqa(q4, k4, k4, 2, 2), msg);
  CHECK_THROWS_MSG(ValueError, check_pack_qkv_gqa(q4, make({4, 3, 4, 8}), k4, 2, 1), msg);
  CHECK_THROWS_MSG(ValueError, check_pack_qkv_gqa(q4, make({4, 8, 8}), k4, 2, 1), msg);
}

TEST_MAIN()
