// rope_pool_fused: every check and message in order (synthetic tensors, so
// also the cases CI cannot build: two GPUs, MPS, mixed devices), the launch
// parameters, and the CPU reference against closed-form cases.
#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>

#include "check.h"
#include "core/angle_sincos.h"
#include "core/errors.h"
#include "core/qk_norm_rope.h"
#include "core/rope_pool.h"
#include "core/token_rms_norm.h"
#include "cpu/float_bits.h"
#include "cpu/rope_pool_reference.h"
#include "tensor_builder.h"

using namespace attnprep::core;
using test::make;

namespace {
const Device cuda0{DeviceType::CUDA, 0}, cuda1{DeviceType::CUDA, 1}, cpu{DeviceType::CPU, 0}, mps{DeviceType::MPS, 0};

RopePoolArgs args(DType dt = DType::BFloat16, Device dev = cuda0, int64_t T = 4, int64_t hq = 8, int64_t hkv = 2,
                  int64_t D = 64) {
  RopePoolArgs a;
  a.q = make({T, hq, D}, dt, dev);
  a.k = make({T, hkv, D}, dt, dev);
  a.v = make({T, hkv, D}, dt, dev);
  a.positions = make({T}, DType::Int64, dev);
  a.slots = make({T}, DType::Int32, dev);
  a.k_pool = make({16, hkv, D}, dt, dev);
  a.v_pool = make({16, hkv, D}, dt, dev);
  a.head_dim = D;
  a.num_qo_heads = hq;
  a.num_kv_heads = hkv;
  return a;
}

#define REJECTS(mutation, msg)                             \
  do {                                                     \
    RopePoolArgs a = args();                               \
    mutation;                                              \
    CHECK_THROWS_MSG(ValueError, check_rope_pool(a), msg); \
  } while (0)
}  // namespace

TEST_CASE("the eleven documented checks, in order") {
  check_rope_pool(args());
  REJECTS(a.q = make({4, 512}), "rope_pool_fused expects q/k/v to be 3-D");
  REJECTS(a.v = make({4, 2, 64, 1}); a.positions = make({4, 1}), "rope_pool_fused expects q/k/v to be 3-D");
  REJECTS(a.slots = make({4, 1}, DType::Int64), "rope_pool_fused expects positions/slots to be 1-D");
  REJECTS(a.k_pool = make({16, 128}); a.num_qo_heads = 1, "rope_pool_fused expects pool tensors to be 3-D");
  REJECTS(a.num_qo_heads = 4, "q shape must be [num_tokens, num_qo_heads, head_dim], got torch.Size([4, 8, 64])");
  REJECTS(a.head_dim = 32, "q shape must be [num_tokens, num_qo_heads, head_dim], got torch.Size([4, 8, 64])");
  REJECTS(a.k = make({5, 2, 64}), "k shape must be [num_tokens, num_kv_heads, head_dim], got torch.Size([5, 2, 64])");
  REJECTS(a.v = make({4, 3, 64}), "v shape must match k shape, got torch.Size([4, 3, 64]) vs torch.Size([4, 2, 64])");
  REJECTS(a.positions = make({5}, DType::Int64), "positions/slots must have one entry per token");
  REJECTS(a.k_pool = make({16, 2, 32}), "k_pool has incompatible shape torch.Size([16, 2, 32])");
  REJECTS(a.v_pool = make({8, 2, 64}),
          "v_pool shape must match k_pool shape, got torch.Size([8, 2, 64]) vs torch.Size([16, 2, 64])");
  REJECTS(a.k = make({4, 2, 64}, DType::Float16), "q/k/v dtypes must match");
  REJECTS(a.v = make({4, 2, 64}, DType::Float32);
          a.v_pool = make({16, 2, 64}, DType::Float64), "q/k/v dtypes must match");
  REJECTS(a.v_pool = make({16, 2, 64}, DType::Float16), "pool dtypes must match q/k/v dtype");
  // a later check never hides an earlier one: everything wrong at once
  REJECTS(a.q = make({4, 8}, DType::Float64, cpu); a.head_dim = 3, "rope_pool_fused expects q/k/v to be 3-D");
}

TEST_CASE("library checks: one device, CUDA or MPS, dtype, dims, indices, strides, cache") {
  REJECTS(a.slots = make({4}, DType::Int64, cuda1), "rope_pool_fused expects all tensors on one device");
  REJECTS(a.v_pool = make({16, 2, 64}, DType::BFloat16, cpu), "rope_pool_fused expects all tensors on one device");
  REJECTS(a.has_cache = true;
          a.cos_sin_cache = make({8, 64}, DType::Float32, mps), "rope_pool_fused expects all tensors on one device");
  {
    RopePoolArgs a = args(DType::BFloat16, cpu);
    CHECK_THROWS_MSG(ValueError, check_rope_pool(a), "rope_pool_fused expects CUDA or MPS tensors");
    check_rope_pool(args(DType::Float16, mps));
    check_rope_pool(args(DType::Float32, cuda1));
    CHECK_THROWS_MSG(ValueError, check_rope_pool(args(DType::Float64)),
                     "rope_pool_fused supports float16, bfloat16 and float32, got torch.float64");
    CHECK_THROWS_MSG(ValueError, check_rope_pool(args(DType::BFloat16, cuda0, 4, 8, 2, 63)),
                     "rope_pool_fused expects an even head_dim in [2, 512], got 63");
    CHECK_THROWS_MSG(ValueError, check_rope_pool(args(DType::BFloat16, cuda0, 4, 1, 1, 514)),
                     "rope_pool_fused expects an even head_dim in [2, 512], got 514");
  }
  REJECTS(a.set_rotary_dim(31), "rope_pool_fused expects an even rotary_dim in [2, head_dim], got 31");
  REJECTS(a.set_rotary_dim(0), "rope_pool_fused expects an even rotary_dim in [2, head_dim], got 0");
  REJECTS(a.set_rotary_dim(66), "rope_pool_fused expects an even rotary_dim in [2, head_dim], got 66");
  REJECTS(a.positions = make({4}, DType::Float32), "rope_pool_fused expects int32 or int64 positions/slots");
  REJECTS(a.slots = make({4}, DType::Int16), "rope_pool_fused expects int32 or int64 positions/slots");
  REJECTS(a.k = make({4, 2, 64}, DType::BFloat16, cuda0, {256, 128, 2}),
          "rope_pool_fused expects q, k, v and the pools to be contiguous in head_dim");
  REJECTS(a.has_cache = true;
          a.cos_sin_cache = make({8, 32}, DType::Float32),
          "cos_sin_cache must have shape [max_position, rotary_dim] = [*, 64], got torch.Size([8, 32])");
  REJECTS(a.has_cache = true; a.cos_sin_cache = make({8, 64}, DType::Float16),
                              "cos_sin_cache must be float32 or bfloat16, got torch.float16");
  REJECTS(a.has_cache = true; a.cos_sin_cache = make({8, 64}, DType::Float32, cuda0, {128, 2}),
                              "cos_sin_cache must be contiguous in its last dimension");
  REJECTS(a.rope_base = 0, "rope_base must be a positive number");
  REJECTS(a.rope_base = std::nan(""), "rope_base must be a positive number");
  // row-strided pools and q/k/v head/row strides are fine
  RopePoolArgs a = args();
  a.k_pool = make({16, 2, 64}, DType::BFloat16, cuda0, {3 * 128, 64, 1});
  a.q = make({4, 8, 64}, DType::BFloat16, cuda0, {12 * 64, 64, 1});
  check_rope_pool(a);
}

TEST_CASE("checks 23-28: kernel limits and memory overlap, after every earlier check") {
  REJECTS(a.q = make({4, 70000, 64}, DType::BFloat16, cuda0, {0, 0, 1});
          a.num_qo_heads = 70000, "rope_pool_fused supports num_qo_heads + num_kv_heads <= 65536, got 70002");
  // empty tensors of 2^62 heads each: the sum, 2^63, is past int64 and still printed exactly
  REJECTS(a.q = make({0, int64_t{1} << 62, 64}); a.k = a.v = make({0, int64_t{1} << 62, 64});
          a.positions = make({0}, DType::Int64); a.slots = make({0}, DType::Int32);
          a.k_pool = a.v_pool = make({16, int64_t{1} << 62, 64}, DType::BFloat16, cuda0, {0, 0, 1});
          a.v_pool.data = static_cast<char*>(a.v_pool.data) + 1;
          a.num_qo_heads = a.num_kv_heads = int64_t{1} << 62,
          "rope_pool_fused supports num_qo_heads + num_kv_heads <= 65536, got 9223372036854775808");
  REJECTS(a.v_pool = a.k_pool, "k_pool and v_pool must not overlap each other or themselves");
  REJECTS(a.k_pool = make({16, 2, 64}, DType::BFloat16, cuda0, {0, 64, 1}),
          "k_pool and v_pool must not overlap each other or themselves");
  REJECTS(a.v_pool.data = static_cast<unsigned char*>(a.k_pool.data) + 2 * 64,
          "k_pool and v_pool must not overlap each other or themselves");
  const char* vs_inputs = "k_pool and v_pool must not overlap q, k, v, positions, slots, cos_sin_cache or the scales";
  REJECTS(a.k_pool.data = a.q.data, vs_inputs);
  REJECTS(a.v_pool.data = a.slots.data, vs_inputs);
  REJECTS(a.has_cache = true; a.cos_sin_cache = make({8, 64}, DType::Float32);
          a.k_pool.data = a.cos_sin_cache.data, vs_inputs);
  const char* inplace =
      "with inplace=True, q and k must not overlap each other, themselves, v, positions, slots, "
      "cos_sin_cache or the scales";
  REJECTS(a.inplace = true; a.k.data = a.q.data, inplace);
  REJECTS(a.inplace = true; a.q = make({4, 8, 64}, DType::BFloat16, cuda0, {0, 64, 1}), inplace);
  REJECTS(a.inplace = true; a.v.data = a.k.data, inplace);
  // reading one tensor twice, or q and k together without inplace, is fine
  RopePoolArgs ok = args();
  ok.v = ok.k;
  check_rope_pool(ok);
  // the k and v halves of one combined cache, q/k/v slices of one projection in place
  RopePoolArgs fused = args();
  fused.inplace = true;
  fused.q = make({4, 8, 64}, DType::BFloat16, cuda0, {12 * 64, 64, 1});
  fused.k = fused.q;
  fused.k.shape[1] = 2;
  fused.k.data = static_cast<unsigned char*>(fused.q.data) + 2 * 8 * 64;
  fused.v = fused.k;
  fused.v.data = static_cast<unsigned char*>(fused.k.data) + 2 * 2 * 64;
  fused.k_pool = make({16, 2, 64}, DType::BFloat16, cuda0, {2 * 128, 64, 1});
  fused.v_pool = fused.k_pool;
  fused.v_pool.data = static_cast<unsigned char*>(fused.k_pool.data) + 2 * 128;
  check_rope_pool(fused);
}

TEST_CASE("KV formats: paged NHD/HND geometry, fp8 pools and scales, in the documented order") {
  // paged pools pass check 3 and are shaped by their layout in check 8
  RopePoolArgs nhd = args();
  nhd.k_pool = make({4, 16, 2, 64});
  nhd.v_pool = make({4, 16, 2, 64});
  check_rope_pool(nhd);
  PoolGeometry g = pool_geometry(nhd.k_pool, KvLayout::NHD);
  CHECK_EQ(g.slots, int64_t{64});
  CHECK_EQ(g.page_size, int64_t{16});
  CHECK_EQ(g.stride_page, int64_t{16 * 128});
  CHECK_EQ(g.stride_offset, int64_t{128});
  CHECK_EQ(g.stride_head, int64_t{64});
  RopePoolArgs hnd = nhd;
  hnd.kv_layout = KvLayout::HND;
  CHECK_THROWS_MSG(ValueError, check_rope_pool(hnd), "k_pool has incompatible shape torch.Size([4, 16, 2, 64])");
  hnd.k_pool = make({4, 2, 16, 64});
  hnd.v_pool = make({4, 2, 16, 64});
  check_rope_pool(hnd);
  g = pool_geometry(hnd.k_pool, KvLayout::HND);
  CHECK_EQ(g.stride_offset, int64_t{64});
  CHECK_EQ(g.stride_head, int64_t{16 * 64});
  const RopePoolParams ph = make_rope_pool_params(hnd, hnd.q, hnd.k);
  CHECK_EQ(ph.pool_size, int64_t{64});
  CHECK_EQ(ph.page_size, int64_t{16});
  CHECK_EQ(ph.vp_stride_offset, int64_t{64});
  // a flat pool is pages of one slot
  const RopePoolParams pf = make_rope_pool_params(args(), args().q, args().k);
  CHECK_EQ(pf.page_size, int64_t{1});
  CHECK_EQ(pf.kp_stride_offset, int64_t{0});
  // the k and v halves of one combined [pages, 2, page, heads, D] buffer
  RopePoolArgs combined = args();
  combined.k_pool = make({4, 16, 2, 64}, DType::BFloat16, cuda0, {2 * 16 * 128, 128, 64, 1});
  combined.v_pool = combined.k_pool;
  combined.v_pool.data = static_cast<unsigned char*>(combined.k_pool.data) + 2 * 16 * 128;
  check_rope_pool(combined);
  CHECK_EQ(make_rope_pool_params(combined, combined.q, combined.k).width, 8);
  REJECTS(a.k_pool = make({4, 16, 2, 64}),
          "v_pool shape must match k_pool shape, got torch.Size([16, 2, 64]) vs "
          "torch.Size([4, 16, 2, 64])");
  REJECTS(a.k_pool = make({4, 16, 2, 64});
          a.v_pool = make({4, 8, 2, 64}),
          "v_pool shape must match k_pool shape, got torch.Size([4, 8, 2, 64]) vs torch.Size([4, 16, 2, 64])");
  REJECTS(a.k_pool = make({4, 16, 3, 64});
          a.v_pool = make({4, 16, 3, 64}), "k_pool has incompatible shape torch.Size([4, 16, 3, 64])");
  REJECTS(a.k_pool = make({4, 16, 2, 64, 1}); a.v_pool = a.k_pool, "rope_pool_fused expects pool tensors to be 3-D");
  REJECTS(a.k_pool = make({int64_t{1} << 22, 1024, 2, 64}, DType::BFloat16, cuda0, {0, 0, 0, 1});
          a.v_pool = make({int64_t{1} << 22, 1024, 2, 64}, DType::BFloat16, cuda0, {0, 0, 0, 1}),
          "rope_pool_fused supports paged pools of fewer than 2^32 slots, got 4294967296");
  CHECK_EQ(static_cast<int>(parse_kv_layout("HND")), static_cast<int>(KvLayout::HND));
  CHECK_THROWS_MSG(ValueError, parse_kv_layout("nhd"), "kv_layout must be \"NHD\" or \"HND\", got nhd");

  // fp8 pools: q's dtype or fp8 (both pools alike), with float32 scales
  auto fp8 = [](DType pool_dtype) {
    RopePoolArgs a = args();
    a.k_pool = make({16, 2, 64}, pool_dtype);
    a.v_pool = make({16, 2, 64}, pool_dtype);
    a.has_k_scale = a.has_v_scale = true;
    a.k_scale = make({}, DType::Float32);
    a.v_scale = make({2}, DType::Float32);
    return a;
  };
  check_rope_pool(fp8(DType::Float8E4M3FN));
  const RopePoolParams p8 = make_rope_pool_params(fp8(DType::Float8E5M2), args().q, args().k);
  CHECK_EQ(p8.pool_fp8, 2);
  CHECK_EQ(p8.k_scale_per_head, 0);
  CHECK_EQ(p8.v_scale_per_head, 1);
  CHECK_EQ(p8.width, 8);  // 8-byte fp8 groups
  RopePoolArgs mixed = fp8(DType::Float8E4M3FN);
  mixed.v_pool = make({16, 2, 64}, DType::Float8E5M2);
  CHECK_THROWS_MSG(ValueError, check_rope_pool(mixed), "pool dtypes must match q/k/v dtype");
  RopePoolArgs no_scale = fp8(DType::Float8E4M3FN);
  no_scale.has_v_scale = false;
  CHECK_THROWS_MSG(ValueError, check_rope_pool(no_scale), "fp8 pools need k_scale and v_scale");
  RopePoolArgs stray = args();
  stray.has_k_scale = true;
  stray.k_scale = make({}, DType::Float32);
  CHECK_THROWS_MSG(ValueError, check_rope_pool(stray),
                   "k_scale and v_scale apply to fp8 pools only, got torch.bfloat16 pools");
  RopePoolArgs f16 = fp8(DType::Float8E4M3FN);
  f16.k_scale = make({}, DType::Float16);
  CHECK_THROWS_MSG(ValueError, check_rope_pool(f16), "k_scale and v_scale must be float32, got torch.float16");
  RopePoolArgs shape = fp8(DType::Float8E4M3FN);
  shape.v_scale = make({3}, DType::Float32);
  CHECK_THROWS_MSG(ValueError, check_rope_pool(shape),
                   "k_scale and v_scale must have shape [], [1] or [num_kv_heads] (contiguous), got torch.Size([3])");
  shape.v_scale = make({2}, DType::Float32, cuda0, {2});
  CHECK_THROWS_MSG(ValueError, check_rope_pool(shape),
                   "k_scale and v_scale must have shape [], [1] or [num_kv_heads] (contiguous), got torch.Size([2])");
  RopePoolArgs dev = fp8(DType::Float8E4M3FN);
  dev.k_scale = make({}, DType::Float32, cpu);
  CHECK_THROWS_MSG(ValueError, check_rope_pool(dev), "rope_pool_fused expects all tensors on one device");
  RopePoolArgs on_mps = args(DType::BFloat16, mps);
  on_mps.k_pool = make({16, 2, 64}, DType::Float8E4M3FN, mps);
  on_mps.v_pool = make({16, 2, 64}, DType::Float8E4M3FN, mps);
  on_mps.has_k_scale = on_mps.has_v_scale = true;
  on_mps.k_scale = on_mps.v_scale = make({}, DType::Float32, mps);
  CHECK_THROWS_MSG(ValueError, check_rope_pool(on_mps), "fp8 pools are supported on CUDA only");
  // an fp8 pool row of bf16 groups needs 8-byte alignment, not 16
  RopePoolArgs odd = fp8(DType::Float8E4M3FN);
  odd.k_pool.data = static_cast<unsigned char*>(odd.k_pool.data) + 8;
  CHECK_EQ(make_rope_pool_params(odd, odd.q, odd.k).width, 8);
  odd.k_pool.data = static_cast<unsigned char*>(odd.k_pool.data) + 4;
  CHECK_EQ(make_rope_pool_params(odd, odd.q, odd.k).width, 1);
}

TEST_CASE("QK norm: checks 34-39 and the device check, in the documented order") {
  auto normed = [](DType wdt = DType::Float32, std::initializer_list<int64_t> shape = {64}) {
    RopePoolArgs a = args();
    a.has_q_norm = a.has_k_norm = true;
    a.q_norm_weight = make(shape, wdt, cuda0);
    a.k_norm_weight = make({64}, DType::Float32, cuda0);
    return a;
  };
  check_rope_pool(normed());
  check_rope_pool(normed(DType::BFloat16));
  RopePoolArgs dev = normed();
  dev.k_norm_weight = make({64}, DType::Float32, cpu);
  CHECK_THROWS_MSG(ValueError, check_rope_pool(dev), "rope_pool_fused expects all tensors on one device");
  CHECK_THROWS_MSG(ValueError, check_rope_pool(normed(DType::Float32, {128})),
                   "q_norm_weight and k_norm_weight must have shape [head_dim] = [64], got torch.Size([128])");
  CHECK_THROWS_MSG(ValueError, check_rope_pool(normed(DType::Float32, {1, 64})),
                   "q_norm_weight and k_norm_weight must have shape [head_dim] = [64], got torch.Size([1, 64])");
  CHECK_THROWS_MSG(ValueError, check_rope_pool(normed(DType::Float16)),
                   "q_norm_weight and k_norm_weight must be float32 or q's dtype (torch.bfloat16), got torch.float16");
  RopePoolArgs strided = normed();
  strided.k_norm_weight = make({64}, DType::Float32, cuda0, {2});
  CHECK_THROWS_MSG(ValueError, check_rope_pool(strided), "q_norm_weight and k_norm_weight must be contiguous");
  for (double eps : {0.0, -1.0, 1e-50, std::nan(""), HUGE_VAL, 1e300}) {
    RopePoolArgs e = normed();
    e.norm_eps = eps;
    char want[96];
    std::snprintf(want, sizeof want, "norm_eps must be a positive finite number, got %g", eps);
    CHECK_THROWS_MSG(ValueError, check_rope_pool(e), want);
  }
  RopePoolArgs no_weight = args();  // the scalars are checked with or without a weight
  no_weight.norm_eps = -1;
  CHECK_THROWS_MSG(ValueError, check_rope_pool(no_weight), "norm_eps must be a positive finite number, got -1");
  RopePoolArgs off = normed();
  off.norm_offset = std::nan("");
  CHECK_THROWS_MSG(ValueError, check_rope_pool(off), "norm_weight_offset must be finite, got nan");
  // a weight inside a pool, or (in place) inside q
  RopePoolArgs in_pool = normed();
  in_pool.k_norm_weight = make({64}, DType::BFloat16, cuda0);
  in_pool.k_norm_weight.data = in_pool.k_pool.data;
  CHECK_THROWS_MSG(ValueError, check_rope_pool(in_pool),
                   "k_pool and v_pool (and q and k with inplace=True) must not overlap q_norm_weight or k_norm_weight");
  RopePoolArgs in_q = normed();
  in_q.q_norm_weight = make({64}, DType::BFloat16, cuda0);
  in_q.q_norm_weight.data = in_q.q.data;
  check_rope_pool(in_q);  // read-only overlap with an input: fine
  in_q.inplace = true;
  CHECK_THROWS_MSG(ValueError, check_rope_pool(in_q),
                   "k_pool and v_pool (and q and k with inplace=True) must not overlap q_norm_weight or k_norm_weight");
  // order: an earlier check wins
  RopePoolArgs both = normed(DType::Float16);
  both.norm_eps = 0;
  CHECK_THROWS_MSG(ValueError, check_rope_pool(both),
                   "q_norm_weight and k_norm_weight must be float32 or q's dtype (torch.bfloat16), got torch.float16");
}

TEST_CASE("M-RoPE: checks 41-43 after every earlier one, the axis of each frequency, the parameter block") {
  auto mrope = [](std::vector<int64_t> section, std::initializer_list<int64_t> pos_shape = {3, 4}) {
    RopePoolArgs a = args();  // head_dim 64: 32 frequencies
    a.positions = make(pos_shape, DType::Int64, cuda0);
    a.has_mrope_section = true;
    a.mrope_section = std::move(section);
    return a;
  };
  check_rope_pool(mrope({8, 12, 12}));
  check_rope_pool(mrope({32, 0, 0}));
  const char* sum = "mrope_section must be three non-negative integers summing to rotary_dim / 2 = 32, got ";
  CHECK_THROWS_MSG(ValueError, check_rope_pool(mrope({8, 12, 13})), std::string(sum) + "[8, 12, 13]");
  CHECK_THROWS_MSG(ValueError, check_rope_pool(mrope({20, 12})), std::string(sum) + "[20, 12]");
  CHECK_THROWS_MSG(ValueError, check_rope_pool(mrope({40, -4, -4})), std::string(sum) + "[40, -4, -4]");
  CHECK_THROWS_MSG(ValueError, check_rope_pool(mrope({INT64_MAX, INT64_MAX, 2})),
                   std::string(sum) + "[9223372036854775807, 9223372036854775807, 2]");
  RopePoolArgs partial = mrope({4, 6, 6});
  partial.set_rotary_dim(32);
  check_rope_pool(partial);
  RopePoolArgs interleaved = args();
  interleaved.mrope_interleaved = true;
  CHECK_THROWS_MSG(ValueError, check_rope_pool(interleaved), "mrope_interleaved=True needs mrope_section");
  CHECK_THROWS_MSG(ValueError, check_rope_pool(mrope({8, 12, 12}, {4})),
                   "M-RoPE positions must have shape [3, num_tokens] = [3, 4], got torch.Size([4])");
  CHECK_THROWS_MSG(ValueError, check_rope_pool(mrope({8, 12, 12}, {3, 5})),
                   "M-RoPE positions must have shape [3, num_tokens] = [3, 4], got torch.Size([3, 5])");
  RopePoolArgs rows = mrope({8, 12, 12});
  rows.has_positions = false;
  rows.has_cache = true;
  rows.cos_sin_cache = make({4, 64}, DType::Float32, cuda0);
  CHECK_THROWS_MSG(ValueError, check_rope_pool(rows),
                   "M-RoPE positions must have shape [3, num_tokens] = [3, 4], got None");
  // 2-D positions without a section: check 2; earlier checks first
  REJECTS(a.positions = make({3, 4}, DType::Int64), "rope_pool_fused expects positions/slots to be 1-D");
  RopePoolArgs early = mrope({1, 1, 1}, {4});
  early.norm_eps = 0;
  CHECK_THROWS_MSG(ValueError, check_rope_pool(early), "norm_eps must be a positive finite number, got 0");
  RopePoolArgs int_dtype = mrope({8, 12, 12});
  int_dtype.positions = make({3, 4}, DType::Float32, cuda0);
  CHECK_THROWS_MSG(ValueError, check_rope_pool(int_dtype), "rope_pool_fused expects int32 or int64 positions/slots");

  // Qwen2.5-VL's sections of 64 frequencies, Qwen3-VL's interleaved ones
  const int qwen2[] = {0, 15, 16, 39, 40, 63}, qwen2_axis[] = {0, 0, 1, 1, 2, 2};
  for (int j = 0; j < 6; ++j) CHECK_EQ(rope_mrope_axis(1, 16, 24, 24, qwen2[j]), qwen2_axis[j]);
  const int qwen3[] = {0, 1, 2, 3, 58, 59, 60, 61, 62, 63}, qwen3_axis[] = {0, 1, 2, 0, 1, 2, 0, 0, 0, 0};
  for (int j = 0; j < 10; ++j) CHECK_EQ(rope_mrope_axis(2, 24, 20, 20, qwen3[j]), qwen3_axis[j]);

  // strides of [3, T] positions and of slots reach the kernels; M-RoPE gathers rows, never the row path
  RopePoolArgs p = mrope({8, 12, 12});
  p.positions = make({3, 4}, DType::Int32, cuda0, {10, 2});
  p.slots = make({4}, DType::Int64, cuda0, {3});
  p.has_cache = true;
  p.cos_sin_cache = make({100, 64}, DType::Float32, cuda0);
  p.mrope_interleaved = true;
  const RopePoolParams prm = make_rope_pool_params(p, p.q, p.k);
  CHECK_EQ(prm.pos_stride_axis, 10);
  CHECK_EQ(prm.pos_stride_token, 2);
  CHECK_EQ(prm.slots_stride, 3);
  CHECK_EQ(prm.mrope, 2);
  CHECK_EQ(prm.mrope_section[1], 12);
  CHECK_EQ(prm.cache_vector, 0);
  p.has_mrope_section = p.mrope_interleaved = false;
  p.positions = make({4}, DType::Int32, cuda0, {5});
  const RopePoolParams one = make_rope_pool_params(p, p.q, p.k);
  CHECK_EQ(one.pos_stride_token, 5);
  CHECK_EQ(one.mrope, 0);
  CHECK_EQ(one.cache_vector, 1);
}

TEST_CASE("fp8 q: checks 44-47 after every earlier one, the device and overlap checks, the parameter block") {
  auto fp8_q = [](std::initializer_list<int64_t> shape = {}, DType dt = DType::Float32, Device dev = cuda0) {
    RopePoolArgs a = args();
    a.has_q_scale = true;
    a.q_scale = make(shape, dt, dev);
    return a;
  };
  check_rope_pool(fp8_q());
  check_rope_pool(fp8_q({1}));
  CHECK_THROWS_MSG(ValueError, check_rope_pool(fp8_q({}, DType::BFloat16)),
                   "q_scale must be float32, got torch.bfloat16");
  CHECK_THROWS_MSG(ValueError, check_rope_pool(fp8_q({2})), "q_scale must have shape [] or [1], got torch.Size([2])");
  CHECK_THROWS_MSG(ValueError, check_rope_pool(fp8_q({1, 1})),
                   "q_scale must have shape [] or [1], got torch.Size([1, 1])");
  RopePoolArgs inplace = fp8_q();
  inplace.inplace = true;
  CHECK_THROWS_MSG(ValueError, check_rope_pool(inplace), "q_scale needs inplace=False: q_rot is float8_e4m3fn");
  RopePoolArgs on_mps = args(DType::BFloat16, mps);
  on_mps.has_q_scale = true;
  on_mps.q_scale = make({}, DType::Float32, mps);
  CHECK_THROWS_MSG(ValueError, check_rope_pool(on_mps), "fp8 q is supported on CUDA only");
  // one device (check 12) and one of "the scales" (27, 28), before its own checks
  CHECK_THROWS_MSG(ValueError, check_rope_pool(fp8_q({2}, DType::Float32, cpu)),
                   "rope_pool_fused expects all tensors on one device");
  RopePoolArgs aliased = fp8_q();
  aliased.q_scale.data = aliased.k_pool.data;
  CHECK_THROWS_MSG(ValueError, check_rope_pool(aliased),
                   "k_pool and v_pool must not overlap q, k, v, positions, slots, cos_sin_cache or the scales");
  RopePoolArgs early = fp8_q({2});
  early.mrope_interleaved = true;  // check 42 first
  CHECK_THROWS_MSG(ValueError, check_rope_pool(early), "mrope_interleaved=True needs mrope_section");
  // q_fp8 in the block; the fp8 q_rot's rows of 1-byte elements keep 8-element groups where their strides allow
  const RopePoolArgs a = fp8_q();
  TensorArg q_rot = make({4, 8, 64}, DType::Float8E4M3FN);
  const RopePoolParams p = make_rope_pool_params(a, q_rot, a.k);
  CHECK_EQ(p.q_fp8, 1);
  CHECK_EQ(p.pool_fp8, 0);
  CHECK_EQ(p.width, 8);
  CHECK_EQ(make_rope_pool_params(args(), args().q, args().k).q_fp8, 0);
  TensorArg odd = make({4, 8, 64}, DType::Float8E4M3FN);
  odd.data = static_cast<unsigned char*>(odd.data) + 4;
  CHECK_EQ(make_rope_pool_params(a, odd, a.k).width, 1);
}

TEST_CASE("no cache write: v, slots and pools absent together, no v items, every other check as before") {
  check_cache_write_given(true, true, true, true);
  check_cache_write_given(false, false, false, false);
  CHECK_THROWS_MSG(ValueError, check_cache_write_given(true, false, true, true),
                   "v, slots, k_pool and v_pool must be given together or all be None");
  RopePoolArgs a = args();
  a.has_pool = false;
  a.v = a.slots = a.k_pool = a.v_pool = TensorArg{};
  check_rope_pool(a);
  const RopePoolParams p = make_rope_pool_params(a, a.q, a.k);
  CHECK_EQ(p.pool_size, 0);
  CHECK_EQ(p.v_items_per_head, 0);
  CHECK_EQ(p.width, 8);
  CHECK_EQ(rope_items_per_token(p), int64_t{10 * p.qk_items_per_head});
  CHECK_EQ(rope_norm_heads_per_token(p), 10);
  CHECK(rope_neox_full(p, 8));
  RopePoolArgs scaled = a;
  scaled.has_k_scale = scaled.has_v_scale = true;
  scaled.k_scale = scaled.v_scale = make({}, DType::Float32, cuda0);
  CHECK_THROWS_MSG(ValueError, check_rope_pool(scaled), "k_scale and v_scale apply to fp8 pools only, got no pools");
  RopePoolArgs shapes = a;
  shapes.k = make({4, 2, 32});
  CHECK_THROWS_MSG(ValueError, check_rope_pool(shapes),
                   "k shape must be [num_tokens, num_kv_heads, head_dim], got torch.Size([4, 2, 32])");
}

TEST_CASE("qk_norm_rope's own checks: ranks, leading dimensions, positions") {
  const TensorArg q = make({2, 5, 4, 64}), k = make({2, 5, 2, 64}), p = make({2, 5}, DType::Int64);
  check_qk_norm_rope(q, k, nullptr, false);
  check_qk_norm_rope(q, k, &p, false);
  const TensorArg p3 = make({3, 2, 5}, DType::Int64);
  check_qk_norm_rope(q, k, &p3, true);
  check_qk_norm_rope(make({7, 4, 64}), make({7, 2, 64}), nullptr, false);
  CHECK_THROWS_MSG(ValueError, check_qk_norm_rope(make({4, 64}), make({5, 2, 64}), nullptr, false),
                   "qk_norm_rope expects q and k of [T, heads, head_dim] or [B, S, heads, head_dim], got "
                   "torch.Size([4, 64]) and torch.Size([5, 2, 64])");
  CHECK_THROWS_MSG(ValueError, check_qk_norm_rope(q, make({2, 4, 2, 64}), nullptr, false),
                   "qk_norm_rope expects q and k with the same leading dimensions, got torch.Size([2, 5, 4, 64]) and "
                   "torch.Size([2, 4, 2, 64])");
  CHECK_THROWS_MSG(ValueError, check_qk_norm_rope(q, k, &p, true),
                   "qk_norm_rope expects positions of shape [3, 2, 5], got torch.Size([2, 5])");
  const TensorArg flat = make({10}, DType::Int64);
  CHECK_THROWS_MSG(ValueError, check_qk_norm_rope(q, k, &flat, false),
                   "qk_norm_rope expects positions of shape [2, 5], got torch.Size([10])");
}

TEST_CASE("qk_norm_rope's per-token norm: its checks in order, its parameters") {
  auto token = [](DType wdt = DType::Float32, Device dev = cuda0) {
    TokenNormArgs a;
    a.x = make({5, 12, 128}, DType::BFloat16, cuda0, {3 * 12 * 128, 128, 1});  // q of a fused projection
    a.weight = make({12 * 128}, wdt, dev);
    a.out = make({5, 12, 128}, DType::BFloat16, cuda0);
    return a;
  };
  check_token_rms_norm(token());
  check_token_rms_norm(token(DType::BFloat16));
  CHECK_THROWS_MSG(ValueError, check_token_rms_norm(token(DType::Float32, mps)),
                   "the per-token QK norm (a weight of heads * head_dim) needs its tensors on one CUDA or MPS device");
  CHECK_THROWS_MSG(ValueError, check_token_rms_norm(token(DType::Float32, cuda1)),
                   "the per-token QK norm (a weight of heads * head_dim) needs its tensors on one CUDA or MPS device");
  TokenNormArgs apple = token(DType::Float32, mps);
  apple.x.device = apple.out.device = mps;
  check_token_rms_norm(apple);
  TokenNormArgs host = token(DType::Float32, cpu);
  host.x.device = host.out.device = cpu;
  CHECK_THROWS_MSG(ValueError, check_token_rms_norm(host),
                   "the per-token QK norm (a weight of heads * head_dim) needs its tensors on one CUDA or MPS device");
  TokenNormArgs shape = token();
  shape.weight = make({128}, DType::Float32, cuda0);
  CHECK_THROWS_MSG(ValueError, check_token_rms_norm(shape),
                   "a per-token q_norm_weight or k_norm_weight must have shape [heads * head_dim] = [1536], got "
                   "torch.Size([128])");
  CHECK_THROWS_MSG(ValueError, check_token_rms_norm(token(DType::Float16)),
                   "q_norm_weight and k_norm_weight must be float32 or q's dtype (torch.bfloat16), got torch.float16");
  TokenNormArgs strided = token();
  strided.weight = make({12 * 128}, DType::Float32, cuda0, {2});
  CHECK_THROWS_MSG(ValueError, check_token_rms_norm(strided), "q_norm_weight and k_norm_weight must be contiguous");
  TokenNormArgs eps = token();
  eps.eps = 0;
  CHECK_THROWS_MSG(ValueError, check_token_rms_norm(eps), "norm_eps must be a positive finite number, got 0");
  const TokenNormParams p = make_token_rms_norm_params(token());
  CHECK_EQ(p.padded, 2048);
  CHECK_EQ(p.x_stride_token, 3 * 12 * 128);
  CHECK_EQ(p.out_stride_token, 12 * 128);
  CHECK_EQ(p.weight_f32, 1);
}

TEST_CASE("QK norm split: lanes x elements = head_dim padded to a power of two") {
  CHECK_EQ(plan_rope_norm_split(128, 8).lanes, 8);  // bf16: two 16-byte groups per lane
  CHECK_EQ(plan_rope_norm_split(128, 8).per_lane, 16);
  CHECK_EQ(plan_rope_norm_split(128, 4).lanes, 16);  // float32
  CHECK_EQ(plan_rope_norm_split(512, 8).lanes, 32);
  CHECK_EQ(plan_rope_norm_split(512, 1).per_lane, 16);
  CHECK_EQ(plan_rope_norm_split(80, 8).lanes, 8);  // 128 padded
  CHECK_EQ(plan_rope_norm_split(2, 8).lanes, 1);   // one lane, two elements
  CHECK_EQ(plan_rope_norm_split(2, 8).per_lane, 2);
  CHECK_EQ(plan_rope_norm_split(72, 1).lanes, 32);  // 128 padded, 4 each
  // which kernel does the norm: the rotation kernel where its items are whole blocks of the sum
  auto in_rotation = [](DType dt, int64_t D, bool neox, int64_t rot = 0) {
    RopePoolArgs a = args(dt, cuda0, 4, 8, 2, D);
    a.is_neox = neox;
    if (rot) a.set_rotary_dim(rot);
    return rope_norm_in_rotation_kernel(make_rope_pool_params(a, a.q, a.k));
  };
  CHECK(in_rotation(DType::BFloat16, 128, true));       // 8 items a head
  CHECK(in_rotation(DType::BFloat16, 512, true));       // 32
  CHECK(!in_rotation(DType::BFloat16, 512, false));     // GPT-J: 64 items
  CHECK(in_rotation(DType::Float32, 128, false));       // 32
  CHECK(!in_rotation(DType::BFloat16, 128, true, 64));  // partial rotary
  CHECK(!in_rotation(DType::BFloat16, 80, true));       // not a power of two
  CHECK(!in_rotation(DType::BFloat16, 2, true));        // one element per access
  for (int64_t D = 2; D <= 512; D += 2)
    for (int32_t w : {1, 4, 8}) {
      const RopeNormSplit s = plan_rope_norm_split(D, w);
      int64_t padded = 1;
      while (padded < D) padded *= 2;
      CHECK(s.lanes * s.per_lane == padded && s.lanes <= 32 && s.per_lane <= RopeCudaPolicy::norm_max_per_lane);
    }
}

TEST_CASE("QK norm in the rotation kernel: every item served once, a head's items in one warp and round") {
  for (DType dt : {DType::BFloat16, DType::Float32})
    for (bool neox : {true, false})
      for (int64_t D : {16, 64, 128, 256})
        for (auto heads : {std::pair<int64_t, int64_t>{32, 8}, {64, 8}, {5, 1}, {28, 4}})
          for (int64_t T : {1, 8, 100, 1023, 1024}) {
            RopePoolArgs a = args(dt, cuda0, T, heads.first, heads.second, D);
            a.is_neox = neox;
            const RopePoolParams p = make_rope_pool_params(a, a.q, a.k);
            if (!rope_norm_in_rotation_kernel(p)) continue;
            const int lanes = p.qk_items_per_head;
            const int n_qk = static_cast<int>((heads.first + heads.second) * lanes);
            const int n_all = static_cast<int>(rope_items_per_token(p));
            const RopeCudaLaunch plan = plan_rope_cuda_launch(n_all, T);
            const RopeCudaIndex ix = plan_rope_cuda_index(p, plan.splits, lanes);
            const int per_block = ix.items_per_block;
            CHECK_EQ(per_block, rope_items_per_block(n_all, static_cast<int>(plan.splits), lanes));
            // the kernel's item -> head split, by multiply and shift
            bool heads_ok = true;
            for (int item = 0; item < n_all; ++item)
              heads_ok &= item < n_qk ? ix.qk_items.div(item) == static_cast<uint32_t>(item / lanes)
                                      : ix.v_items.div(item - n_qk) ==
                                            static_cast<uint32_t>((item - n_qk) / p.v_items_per_head);
            CHECK(heads_ok);
            // (block, round, warp) of every item, as the kernel walks them
            std::vector<int64_t> place(static_cast<size_t>(n_all), -1);
            bool once = true;
            for (int b = 0; b < plan.splits; ++b) {
              const int begin = b * per_block, end = std::min(n_all, begin + per_block);
              for (int item = begin; item < end; ++item) {
                const int r = (item - begin) / plan.threads, thread = (item - begin) % plan.threads;
                once &= place[static_cast<size_t>(item)] < 0;
                place[static_cast<size_t>(item)] = (int64_t{b} * 1000000 + r) * 64 + thread / 32;
              }
            }
            bool covered = true, together = true;
            for (int item = 0; item < n_all; ++item) covered &= place[static_cast<size_t>(item)] >= 0;
            for (int item = 0; item < n_qk; ++item)
              together &= place[static_cast<size_t>(item)] == place[static_cast<size_t>(item / lanes * lanes)];
            CHECK(once && covered && together);
          }
}

TEST_CASE("reference: QK norm in float32, pairwise sum, Qwen3 and Gemma rounding") {
  // head of 3 (padded to 4): ss = (1 + 4) + (9 + 0) = 14, mean 14 / 3
  attnprep::core::TensorArg w = make({3}, DType::Float32, cpu);
  float wv[3] = {1.0f, 2.0f, 0.5f};
  w.data = wv;
  const std::vector<float> x = {1.0f, -2.0f, 3.0f};
  const float inv = 1.0f / std::sqrt(14.0f / 3.0f + 1e-6f);
  auto y = attnprep::cpu::rms_norm_head(x, w, DType::Float32, 1e-6, 0.0);
  for (int d = 0; d < 3; ++d) CHECK_EQ(y[d], (x[d] * inv) * wv[d]);
  y = attnprep::cpu::rms_norm_head(x, w, DType::Float32, 1e-6, 1.0);
  for (int d = 0; d < 3; ++d) CHECK_EQ(y[d], (x[d] * inv) * (1.0f + wv[d]));
  // bf16, offset 0: normalized rounded to bf16 before the weight, the product rounded again
  y = attnprep::cpu::rms_norm_head(x, w, DType::BFloat16, 1e-6, 0.0);
  using attnprep::cpu::bf16_to_float;
  using attnprep::cpu::float_to_bf16;
  for (int d = 0; d < 3; ++d)
    CHECK_EQ(y[d], bf16_to_float(float_to_bf16(bf16_to_float(float_to_bf16(x[d] * inv)) * wv[d])));
  // pairwise, not sequential: 1 + 2^-24 + 2^-24 + ... sequentially stays 1
  std::vector<float> tiny(8, std::ldexp(1.0f, -12));
  tiny[0] = 1.0f;
  attnprep::core::TensorArg ones = make({8}, DType::Float32, cpu);
  std::vector<float> one(8, 1.0f);
  ones.data = one.data();
  const float pair = 1.0f + ((std::ldexp(1.0f, -24) + std::ldexp(1.0f, -24)) + 2 * std::ldexp(1.0f, -23));
  y = attnprep::cpu::rms_norm_head(tiny, ones, DType::Float32, 1e-6, 0.0);
  CHECK_EQ(y[0], 1.0f * (1.0f / std::sqrt(pair / 8.0f + 1e-6f)));
}

TEST_CASE("inv_freq is 1 / base^(2i/rot) rounded once to float32") {
  const auto f = rope_inv_freq(10000.0, 128);
  CHECK_EQ(f.size(), size_t{64});
  CHECK_EQ(f[0], 1.0f);
  CHECK_EQ(f[1], static_cast<float>(1.0 / std::pow(10000.0, 2.0 / 128)));
  CHECK_EQ(f[63], static_cast<float>(1.0 / std::pow(10000.0, 126.0 / 128)));
}

TEST_CASE("params: 16-byte groups when everything allows, one element otherwise") {
  RopePoolArgs a = args();
  CHECK_EQ(make_rope_pool_params(a, a.q, a.k).width, 8);
  CHECK_EQ(make_rope_pool_params(a, a.q, a.k).qk_items_per_head, 4);  // 32 pairs of halves / 8
  CHECK_EQ(make_rope_pool_params(a, a.q, a.k).v_items_per_head, 4);   // 8 groups, paired half a head apart
  RopePoolArgs odd = args(DType::BFloat16, cuda0, 4, 8, 2, 72);       // NeoX half 36: one element at a time
  CHECK_EQ(make_rope_pool_params(odd, odd.q, odd.k).width, 1);
  CHECK_EQ(make_rope_pool_params(odd, odd.q, odd.k).v_items_per_head, 36);  // 72 elements, paired
  odd.is_neox = false;                                                      // GPT-J: 9 groups of 8, one per item
  CHECK_EQ(make_rope_pool_params(odd, odd.q, odd.k).width, 8);
  CHECK_EQ(make_rope_pool_params(odd, odd.q, odd.k).v_items_per_head, 9);
  a.set_rotary_dim(24);  // half 12: not a multiple of 8
  CHECK_EQ(make_rope_pool_params(a, a.q, a.k).width, 1);
  CHECK_EQ(make_rope_pool_params(a, a.q, a.k).qk_items_per_head, 12 + 40);
  a.is_neox = false;  // GPT-J: 24 elements = 3 groups of 8
  CHECK_EQ(make_rope_pool_params(a, a.q, a.k).width, 8);
  CHECK_EQ(make_rope_pool_params(a, a.q, a.k).qk_items_per_head, 3 + 5);
  RopePoolArgs b = args();
  b.v.data = static_cast<unsigned char*>(b.v.data) + 2;  // misaligned
  CHECK_EQ(make_rope_pool_params(b, b.q, b.k).width, 1);
  RopePoolArgs c = args(DType::Float32);
  CHECK_EQ(make_rope_pool_params(c, c.q, c.k).width, 4);
  c.k_pool = make({16, 2, 64}, DType::Float32, cuda0, {129, 64, 1});  // row stride of 129 floats
  CHECK_EQ(make_rope_pool_params(c, c.q, c.k).width, 1);
  CHECK_EQ(make_rope_pool_params(c, c.q, c.k).kp_stride_page, 129);
  CHECK_EQ(make_rope_pool_params(args(), args().q, args().k).inv_freq[0], 1.0f);
}

TEST_CASE("CUDA launch: one-round QK-norm blocks stage their weights and cos/sin only in small calls") {
  const int64_t per_sm = RopeCudaPolicy::norm_stage_max_blocks_per_sm;
  CHECK(rope_norm_stage(1, 132));
  CHECK(rope_norm_stage(per_sm * 132, 132));
  CHECK(!rope_norm_stage(per_sm * 132 + 1, 132));
  // the benchmark's 32/8 heads at T = 128 (3 blocks a token) is staged on an H200, T = 512 is not
  CHECK(rope_norm_stage(128 * 3, 132));
  CHECK(!rope_norm_stage(512 * 3, 132));
  CHECK(!rope_norm_stage(1, 0));  // multiprocessors unknown: never
  CHECK(!rope_norm_stage(1, -1));
}

TEST_CASE("CUDA launch: one-round QK-norm blocks computing cos/sin have a table warp where they fit in one wave") {
  // the table warp's blocks keep the threads per multiprocessor of the 128-thread blocks
  CHECK_EQ(RopeCudaPolicy::norm_table_warp_min_blocks_per_sm * (RopeCudaPolicy::max_threads + 32),
           RopeCudaPolicy::norm_one_round_min_blocks_per_sm * RopeCudaPolicy::max_threads);
  const int64_t per_sm = RopeCudaPolicy::norm_table_warp_min_blocks_per_sm;
  const int64_t fp8_per_sm = RopeCudaPolicy::norm_table_warp_fp8_min_blocks_per_sm;
  CHECK(fp8_per_sm < per_sm);
  CHECK(rope_table_warp(1, 132, false));
  CHECK(rope_table_warp(per_sm * 132, 132, false));
  CHECK(!rope_table_warp(per_sm * 132 + 1, 132, false));
  CHECK(rope_table_warp(fp8_per_sm * 132, 132, true));
  CHECK(!rope_table_warp(fp8_per_sm * 132 + 1, 132, true));
  // on an H200: 64/8 heads (5 blocks a token) at T = 128 have it, at T = 256 not
  CHECK(rope_table_warp(128 * 5, 132, false));
  CHECK(!rope_table_warp(256 * 5, 132, false));
  CHECK(!rope_table_warp(1, 0, false));  // multiprocessors unknown: never
  CHECK(!rope_table_warp(1, -1, true));
}

TEST_CASE("CUDA launch shape: whole warps, whole rounds, one round per block when split") {
  // The benchmark's shape: 32/8 heads, head_dim 128, bf16 -> 40 heads x 8 rotated pairs of groups + 8 v heads
  // x 8 pairs of groups = 384 items, three whole rounds of 128 threads.
  const RopePoolArgs b = args(DType::BFloat16, cuda0, 8192, 32, 8, 128);
  const int64_t items = rope_items_per_token(make_rope_pool_params(b, b.q, b.k));
  CHECK_EQ(items, 384);
  const RopeCudaLaunch bench = plan_rope_cuda_launch(items, 8192, 128, 1024);
  CHECK_EQ(bench.threads, 128);
  CHECK_EQ(bench.splits, 1);
  CHECK(bench.several_rounds);  // 3 rounds: the kernel with the L2 requests ahead
  CHECK_EQ(plan_rope_cuda_launch(items, 8, 128, 1024).splits, 3);
  CHECK_EQ(plan_rope_cuda_launch(448, 8, 128, 1024).splits, 4);
  CHECK(!plan_rope_cuda_launch(448, 1023, 128, 1024).several_rounds);
  CHECK(plan_rope_cuda_launch(448, 1024, 128, 1024).several_rounds);
  CHECK(!plan_rope_cuda_launch(128, 4096, 128, 1024).several_rounds);           // one round even unsplit
  CHECK(plan_rope_cuda_launch(int64_t{1} << 30, 8, 128, 1024).several_rounds);  // past the split limit
  CHECK_EQ(plan_rope_cuda_launch(24, 8, 128, 1024).threads, 32);
  CHECK_EQ(plan_rope_cuda_launch(0, 8, 128, 1024).threads, 32);
  CHECK_EQ(plan_rope_cuda_launch(0, 8, 128, 1024).splits, 1);
  CHECK_EQ(plan_rope_cuda_launch(448, 8, 256, 1024).threads, 224);
  CHECK_EQ(plan_rope_cuda_launch(int64_t{1} << 30, 8, 128, 1024).splits, 65535);  // gridDim.y limit
  for (int32_t max_threads : {64, 128, 256})
    for (int64_t items = 1; items <= 4096; ++items) {
      const RopeCudaLaunch l = plan_rope_cuda_launch(items, 1, max_threads, 1024);
      const int64_t rounds = (items + max_threads - 1) / max_threads;
      CHECK(l.threads % 32 == 0 && l.threads >= 32 && l.threads <= max_threads);
      CHECK(l.threads * rounds >= items);                     // the rounds cover every item
      CHECK(l.threads * rounds - items < 32 * rounds);        // less than a warp idle per round
      CHECK_EQ(l.splits, rounds);                             // split: one block per round...
      CHECK((items + l.splits - 1) / l.splits <= l.threads);  // ...each block's slice in one round
      CHECK(!l.several_rounds);
      const RopeCudaLaunch whole = plan_rope_cuda_launch(items, 1024, max_threads, 1024);
      CHECK_EQ(whole.splits, 1);
      CHECK_EQ(whole.several_rounds, items > whole.threads);
    }
}

TEST_CASE("CUDA launch: pools of no slots plan without a division by zero") {
  // pages of no slots, and no pages of 2^32 slots (whose 32-bit divisor would read 0)
  for (int64_t pages : {int64_t{3}, int64_t{0}})
    for (KvLayout layout : {KvLayout::NHD, KvLayout::HND}) {
      const int64_t page = pages ? 0 : int64_t{1} << 32;
      RopePoolArgs a = args();
      a.kv_layout = layout;
      a.k_pool = layout == KvLayout::NHD ? make({pages, page, 2, 64}) : make({pages, 2, page, 64});
      a.v_pool = layout == KvLayout::NHD ? make({pages, page, 2, 64}) : make({pages, 2, page, 64});
      check_rope_pool(a);  // valid: every slot is past the pool
      const RopePoolParams p = make_rope_pool_params(a, a.q, a.k);
      CHECK_EQ(p.pool_size, int64_t{0});
      CHECK_EQ(p.page_size, page);
      // the kernel divides only slots in [0, pool_size): none here, and no divisor of 0 is formed
      CHECK_EQ(plan_rope_cuda_index(p, 1, 1).page.divisor, 1u);
    }
}

TEST_CASE("CUDA launch: a several-round call's last wave in one-round slices, every item served once") {
  // The benchmark's shape on an H200 with the QK norm (9 blocks x 132 multiprocessors): 2048 tokens of 3
  // rounds end with the 396 tokens whose 1188 slices fill the resident blocks once.
  const RopePoolArgs b = args(DType::BFloat16, cuda0, 2048, 32, 8, 128);
  const RopePoolParams bp = make_rope_pool_params(b, b.q, b.k);
  RopeCudaIndex bix = plan_rope_cuda_index(bp, 1, 8);
  CHECK_EQ(plan_rope_cuda_tail(bix, 384, 2048, 128, 8, 1188), 2048 + 396 * 2);
  CHECK_EQ(bix.whole_tokens, 2048u - 396u);
  CHECK_EQ(bix.tail.divisor, 3u);
  CHECK_EQ(bix.tail_items_per_block, 128);
  // a token's slices in reverse: its last slice (k and v heads) in its first block
  CHECK_EQ(rope_tail_slice(bix, 1652).token, 1652u);
  CHECK_EQ(rope_tail_slice(bix, 1652).begin, 256);
  CHECK_EQ(rope_tail_slice(bix, 1654).begin, 0);
  CHECK_EQ(rope_tail_slice(bix, 2839).token, 2047u);
  // ... past the first wave by fewer tokens than that: those tokens only
  CHECK_EQ(plan_rope_cuda_tail(bix, 384, 1200, 128, 8, 1188), 1200 + 12 * 2);
  CHECK_EQ(bix.whole_tokens, 1188u);
  // ... a tail of half the tokens (tail_share 2) at 10 blocks x 132: 1320 / 3 / 2 = 220 tokens
  CHECK_EQ(plan_rope_cuda_tail(bix, 384, 2048, 128, 8, 1320, 2), 2048 + 220 * 2);
  CHECK_EQ(bix.whole_tokens, 2048u - 220u);
  // no tail: within one wave, one-round tokens, resident blocks unknown, a grid past 2^31 - 1 blocks
  for (auto c : {std::array<int64_t, 3>{384, 1188, 1188},
                 {128, 5000, 1188},
                 {384, 5000, 0},
                 {384, 5000, -1},
                 {384, kRopeMaxTokens - 100, 1188}}) {
    RopeCudaIndex ix = plan_rope_cuda_index(bp, 1, 8);
    CHECK_EQ(plan_rope_cuda_tail(ix, c[0], c[1], 128, 8, c[2]), c[1]);
    CHECK_EQ(ix.whole_tokens, UINT32_MAX);
  }
  // The kernel's walk (rope_pool_kernel): block x < whole_tokens serves token x whole, in rounds of `threads`;
  // past it, the slice rope_tail_slice gives, in one round. Every item of every token exactly once; with the
  // QK norm (lanes > 1) slices start on head boundaries.
  for (auto heads : {std::pair<int64_t, int64_t>{32, 8}, {64, 8}, {5, 1}, {48, 8}, {28, 4}})
    for (bool norm : {false, true})
      for (int64_t T : {1, 7, 50, 51, 64, 97})
        for (int64_t resident : {int64_t{0}, int64_t{6}, int64_t{50}}) {
          const RopePoolArgs a = args(DType::BFloat16, cuda0, T, heads.first, heads.second, 128);
          const RopePoolParams p = make_rope_pool_params(a, a.q, a.k);
          const int lanes = norm ? p.qk_items_per_head : 1;
          const int n_all = static_cast<int>(rope_items_per_token(p));
          const RopeCudaLaunch plan = plan_rope_cuda_launch(n_all, T, 128, 0);  // a block per token
          RopeCudaIndex ix = plan_rope_cuda_index(p, plan.splits, lanes);
          const int64_t blocks = plan_rope_cuda_tail(ix, n_all, T, plan.threads, lanes, resident);
          const int64_t rounds = (n_all + plan.threads - 1) / plan.threads;
          CHECK_EQ(blocks > T, rounds > 1 && resident > 0 && T > resident);
          std::vector<int> served(static_cast<size_t>(T * n_all), 0);
          bool in_range = true, one_round = true, on_heads = true;
          for (int64_t x = 0; x < blocks; ++x) {
            int64_t t = x;
            int begin = 0, share = ix.items_per_block;
            const bool sliced = static_cast<uint64_t>(x) >= ix.whole_tokens;
            if (sliced) {
              const RopeTailSlice slice = rope_tail_slice(ix, static_cast<uint32_t>(x));
              t = slice.token;
              begin = slice.begin;
              share = slice.share;
              one_round &= share <= plan.threads;
              on_heads &= begin % lanes == 0;
            }
            in_range &= t < T;
            if (t >= T) continue;
            for (int item = begin; item < std::min(n_all, begin + share); ++item)
              ++served[static_cast<size_t>(t * n_all + item)];
          }
          CHECK(in_range && one_round && on_heads);
          CHECK(std::all_of(served.begin(), served.end(), [](int n) { return n == 1; }));
        }
}

namespace {
// Host-backed float32 case for the reference.
struct HostCase {
  RopePoolArgs a;
  test::HostBuffer bq, bk, bv, bp, bs, bkp, bvp, bc;
};
void fill_f32(TensorArg& t, test::HostBuffer& b, std::initializer_list<float> values) {
  b.attach(t, 1);
  float* p = static_cast<float*>(t.data);
  size_t i = 0;
  for (float v : values) p[i++] = v;
}
}  // namespace

TEST_CASE("reference: closed-form rotations") {
  HostCase h;
  RopePoolArgs& a = h.a;
  a = args(DType::Float32, cuda0, 2, 1, 1, 4);
  fill_f32(a.q, h.bq, {1, 2, 3, 4, 1, 2, 3, 4});
  fill_f32(a.k, h.bk, {1, 0, 0, 1, 1, 0, 0, 1});
  fill_f32(a.v, h.bv, {0, 0, 0, 0, 0, 0, 0, 0});
  h.bp.attach(a.positions, 1);
  static_cast<int64_t*>(a.positions.data)[0] = 0;  // angle 0: identity
  static_cast<int64_t*>(a.positions.data)[1] = 3;
  h.bs.attach(a.slots, 1);
  static_cast<int32_t*>(a.slots.data)[0] = -1;
  static_cast<int32_t*>(a.slots.data)[1] = 5;
  a.k_pool = make({8, 1, 4}, DType::Float32);
  a.v_pool = a.k_pool;
  a.rope_base = 100.0;
  auto r = attnprep::cpu::rope_pool_reference(a);
  // token 0, position 0: unchanged
  for (int d = 0; d < 4; ++d) CHECK_EQ(r.q_rot[d], static_cast<double>(d + 1));
  // token 1, position 3, NeoX over 4 dims: pairs (0, 2) with inv_freq 1 and (1, 3) with inv_freq 1/10
  const double a0 = static_cast<float>(3.0f * 1.0f), a1 = static_cast<float>(3.0f * static_cast<float>(0.1));
  const double want[4] = {1 * std::cos(a0) - 3 * std::sin(a0), 2 * std::cos(a1) - 4 * std::sin(a1),
                          3 * std::cos(a0) + 1 * std::sin(a0), 4 * std::cos(a1) + 2 * std::sin(a1)};
  for (int d = 0; d < 4; ++d) CHECK(std::fabs(r.q_rot[4 + d] - want[d]) < 1e-15);
  // slot -1 is skipped, slot 5 gets token 1
  CHECK_EQ(r.pool_writer[5], int64_t{1});
  int written = 0;
  for (int64_t w : r.pool_writer) written += w >= 0;
  CHECK_EQ(written, 1);

  // GPT-J pairs (0, 1) and (2, 3); partial rotary 2 leaves dims 2, 3 alone
  a.is_neox = false;
  a.set_rotary_dim(2);
  r = attnprep::cpu::rope_pool_reference(a);
  CHECK(std::fabs(r.q_rot[4] - (1 * std::cos(a0) - 2 * std::sin(a0))) < 1e-15);
  CHECK(std::fabs(r.q_rot[5] - (2 * std::cos(a0) + 1 * std::sin(a0))) < 1e-15);
  CHECK_EQ(r.q_rot[6], 3.0);
  CHECK_EQ(r.q_rot[7], 4.0);
  // k = (1, 0, 0, 1) keeps its norm under any rotation
  const double n =
      r.k_rot[4] * r.k_rot[4] + r.k_rot[5] * r.k_rot[5] + r.k_rot[6] * r.k_rot[6] + r.k_rot[7] * r.k_rot[7];
  CHECK(std::fabs(n - 2.0) < 1e-15);
}

TEST_CASE("reference: cos_sin_cache values are used exactly; out-of-range rows are NaN and not written") {
  HostCase h;
  RopePoolArgs& a = h.a;
  a = args(DType::Float32, cuda0, 2, 1, 1, 2);
  fill_f32(a.q, h.bq, {2, 3, 2, 3});
  fill_f32(a.k, h.bk, {1, 1, 1, 1});
  fill_f32(a.v, h.bv, {0, 0, 0, 0});
  h.bp.attach(a.positions, 1);
  static_cast<int64_t*>(a.positions.data)[0] = 1;
  static_cast<int64_t*>(a.positions.data)[1] = 7;  // past the 2-row table
  h.bs.attach(a.slots, 1);
  static_cast<int32_t*>(a.slots.data)[0] = 0;
  static_cast<int32_t*>(a.slots.data)[1] = 1;
  a.k_pool = make({4, 1, 2}, DType::Float32);
  a.v_pool = a.k_pool;
  a.has_cache = true;
  a.cos_sin_cache = make({2, 2}, DType::Float32);
  fill_f32(a.cos_sin_cache, h.bc, {1, 0, 0.25f, 0.5f});  // row 1: cos 0.25, sin 0.5 (not a real angle)
  auto r = attnprep::cpu::rope_pool_reference(a);
  CHECK_EQ(r.q_rot[0], 2 * 0.25 - 3 * 0.5);
  CHECK_EQ(r.q_rot[1], 3 * 0.25 + 2 * 0.5);
  CHECK(std::isnan(r.q_rot[2]) && !r.pos_ok[1]);
  CHECK_EQ(r.pool_writer[0], int64_t{0});
  CHECK_EQ(r.pool_writer[1], int64_t{-1});
}

TEST_CASE("float16/bfloat16 conversions round to nearest even") {
  using namespace attnprep::cpu;
  CHECK_EQ(float_to_half(1.0f), uint16_t{0x3c00});
  CHECK_EQ(half_to_float(0x3c00), 1.0f);
  CHECK_EQ(float_to_half(65504.0f), uint16_t{0x7bff});
  CHECK_EQ(float_to_half(1e6f), uint16_t{0x7c00});
  CHECK_EQ(half_to_float(0x0001), 5.9604644775390625e-8f);
  CHECK_EQ(float_to_half(5.9604644775390625e-8f), uint16_t{0x0001});
  CHECK_EQ(float_to_half(1.0f + 1.0f / 2048), uint16_t{0x3c00});  // tie to even
  CHECK_EQ(float_to_half(1.0f + 3.0f / 2048), uint16_t{0x3c02});
  CHECK_EQ(float_to_bf16(1.0f + 1.0f / 256), uint16_t{0x3f80});  // tie to even
  CHECK_EQ(bf16_to_float(0x3f81), 1.0078125f);
  for (uint32_t hbits = 0; hbits < 0x7c00; hbits += 7)  // round trip over finite halves
    CHECK_EQ(float_to_half(half_to_float(static_cast<uint16_t>(hbits))), static_cast<uint16_t>(hbits));
}

// The kernel's sin/cos (core/angle_sincos.h) against double sin/cos of the
// same float32 angle: every result is the double value rounded to nearest
// (at most half a float32 ulp; 0.5 + 1e-3 leaves room for a double rounding),
// on every rotary angle of positions below 2^21 at three frequencies, on
// random magnitudes from 2^-30 to 2^30, next to multiples of pi/2 (where the
// reduction cancels most digits), and on the fallback range past 2^52.
TEST_CASE("angle_sincos is within 0.501 ulp at every magnitude on the host") {
  auto ulp = [](double d) {
    int e;
    std::frexp(std::fabs(d), &e);
    return std::ldexp(1.0, e - 24);
  };
  double worst = 0;
  float worst_angle = 0;
  auto check = [&](float a) {
    float s, c;
    angle_sincos(a, &s, &c);
    const double ds = std::sin(static_cast<double>(a)), dc = std::cos(static_cast<double>(a));
    const double err = std::max(std::fabs(s - ds) / ulp(ds), std::fabs(c - dc) / ulp(dc));
    if (!(err <= worst)) {
      worst = err;
      worst_angle = a;
    }
  };
  for (int p = 0; p < (1 << 21); ++p)
    for (float f : {1.0f, 0.8659643f, 1e-4f}) check(static_cast<float>(p) * f);
  std::mt19937_64 gen(20261129);
  std::uniform_real_distribution<double> exponent(-30, 30);
  for (int i = 0; i < 1000000; ++i) check(static_cast<float>(std::exp2(exponent(gen))) * (i & 1 ? 1.0f : -1.0f));
  for (int64_t k = 1; k < (1 << 22); k += 7) {
    const float f = static_cast<float>(static_cast<double>(k) * 1.5707963267948966);
    check(f);
    check(std::nextafterf(f, 0.0f));
    check(std::nextafterf(f, 1e30f));
  }
  // past 2^52 (the fallback): every exponent, random mantissas, both signs
  for (int i = 0; i < 400000; ++i) {
    const uint32_t bits = (static_cast<uint32_t>(179 + i % 76) << 23) | static_cast<uint32_t>(gen() & 0x7fffffu);
    float a;
    std::memcpy(&a, &bits, sizeof a);
    check(i & 1 ? -a : a);
  }
  for (float big : {0x1p52f, -0x1p60f, 3e38f, FLT_MAX, -FLT_MAX, std::nextafterf(0x1p52f, 0.0f)}) check(big);
  if (!(worst <= 0.501)) std::fprintf(stderr, "worst: %.4f ulp at angle %.9g\n", worst, worst_angle);
  CHECK(worst <= 0.501);
  float s = 0, c = 0;
  angle_sincos(INFINITY, &s, &c);
  CHECK(std::isnan(s) && std::isnan(c));
  angle_sincos(NAN, &s, &c);
  CHECK(std::isnan(s) && std::isnan(c));
}

TEST_MAIN()
