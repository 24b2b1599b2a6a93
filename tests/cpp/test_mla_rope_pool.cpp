// mla_rope_pool_fused: every check and message in order on synthetic tensors (two GPUs, MPS and mixed devices
// included), and the parameter block the kernels get.
#include <string>

#include "check.h"
#include "core/errors.h"
#include "core/mla_rope_pool.h"
#include "tensor_builder.h"

using namespace attnprep::core;
using test::make;

namespace {
const Device cuda0{DeviceType::CUDA, 0}, cuda1{DeviceType::CUDA, 1}, cpu{DeviceType::CPU, 0}, mps{DeviceType::MPS, 0};

// DeepSeek-V3 per tensor-parallel rank: 16 heads of 128 + 64, latent 512 + 64, a paged combined cache.
MlaRopeArgs args(DType dt = DType::BFloat16, Device dev = cuda0, int64_t T = 4) {
  MlaRopeArgs a;
  a.q = make({T, 16, 192}, dt, dev);
  a.kv_c = make({T, 512}, dt, dev);
  a.k_pe = make({T, 64}, dt, dev);
  a.positions = make({T}, DType::Int64, dev);
  a.slots = make({T}, DType::Int32, dev);
  a.kv_cache = make({8, 64, 576}, dt, dev);
  return a;
}

#define REJECTS(mutation, msg)                                 \
  do {                                                         \
    MlaRopeArgs a = args();                                    \
    mutation;                                                  \
    CHECK_THROWS_MSG(ValueError, check_mla_rope_pool(a), msg); \
  } while (0)
}  // namespace

TEST_CASE("shapes and dtypes: checks 1-9") {
  check_mla_rope_pool(args());
  REJECTS(a.q = make({4, 192}), "mla_rope_pool_fused expects q to be 3-D and kv_c, k_pe 2-D");
  REJECTS(a.k_pe = make({4, 1, 64}), "mla_rope_pool_fused expects q to be 3-D and kv_c, k_pe 2-D");
  REJECTS(a.slots = make({4, 1}, DType::Int32), "mla_rope_pool_fused expects positions/slots to be 1-D");
  REJECTS(a.kv_cache = make({2, 8, 64, 576}), "mla_rope_pool_fused expects caches of 2 or 3 dimensions");
  REJECTS(a.kv_c = make({5, 512}), "kv_c, k_pe, positions and slots must have q.shape[0] = 4 rows");
  REJECTS(a.positions = make({3}, DType::Int64), "kv_c, k_pe, positions and slots must have q.shape[0] = 4 rows");
  REJECTS(a.q = make({4, 16, 32}), "q.shape[2] must be at least k_pe.shape[1] = 64, got 32");
  REJECTS(a.kv_cache = make({8, 64, 512}),
          "kv_cache must have shape [slots, 576] or [pages, page_size, 576], got torch.Size([8, 64, 512])");
  // separate caches: kv_c's L values, then kpe_cache's R with the same slots
  MlaRopeArgs sep = args();
  sep.kv_cache = make({8, 64, 512});
  sep.has_kpe_cache = true;
  sep.kpe_cache = make({8, 64, 64});
  check_mla_rope_pool(sep);
  sep.kpe_cache = make({8, 32, 64});
  CHECK_THROWS_MSG(ValueError, check_mla_rope_pool(sep),
                   "kpe_cache must have shape [slots, 64] or [pages, page_size, 64] with kv_cache's slots, got "
                   "torch.Size([8, 32, 64])");
  sep.kpe_cache = make({512, 64});
  CHECK_THROWS_MSG(ValueError, check_mla_rope_pool(sep),
                   "kpe_cache must have shape [slots, 64] or [pages, page_size, 64] with kv_cache's slots, got "
                   "torch.Size([512, 64])");
  REJECTS(a.k_pe = make({4, 64}, DType::Float16), "q, kv_c and k_pe dtypes must match");
  REJECTS(a.kv_cache = make({8, 64, 576}, DType::Float16),
          "cache dtypes must be q's dtype, float8_e4m3fn or float8_e5m2 (both caches alike)");
  MlaRopeArgs mixed = sep;
  mixed.kpe_cache = make({8, 64, 64}, DType::Float8E4M3FN);
  CHECK_THROWS_MSG(ValueError, check_mla_rope_pool(mixed),
                   "cache dtypes must be q's dtype, float8_e4m3fn or float8_e5m2 (both caches alike)");
}

TEST_CASE("device, dtype, sizes, indices, strides, table: checks 10-23") {
  REJECTS(a.slots = make({4}, DType::Int32, cuda1), "mla_rope_pool_fused expects all tensors on one device");
  CHECK_THROWS_MSG(ValueError, check_mla_rope_pool(args(DType::BFloat16, cpu)),
                   "mla_rope_pool_fused expects CUDA or MPS tensors");
  check_mla_rope_pool(args(DType::Float32, mps));
  CHECK_THROWS_MSG(ValueError, check_mla_rope_pool(args(DType::Float64)),
                   "mla_rope_pool_fused supports float16, bfloat16 and float32, got torch.float64");
  REJECTS(a.k_pe = make({4, 63});
          a.kv_cache = make({8, 64, 575}),
          "mla_rope_pool_fused expects an even rope dimension (k_pe.shape[1]) in [2, 512], got 63");
  REJECTS(a.k_pe = make({4, 514}); a.q = make({4, 16, 600});
          a.kv_cache = make({8, 64, 1026}),
          "mla_rope_pool_fused expects an even rope dimension (k_pe.shape[1]) in [2, 512], got 514");
  REJECTS(a.kv_c = make({4, 4096}); a.kv_cache = make({8, 64, 4160}),
                                    "mla_rope_pool_fused expects kv_lora_rank (kv_c.shape[1]) in [1, 2048], got 4096");
  REJECTS(a.positions = make({4}, DType::Float32), "mla_rope_pool_fused expects int32 or int64 positions/slots");
  REJECTS(a.kv_c = make({4, 512}, DType::BFloat16, cuda0, {1024, 2}),
          "mla_rope_pool_fused expects q, kv_c, k_pe and the caches to be contiguous in their last dimension");
  // a strided row (a slice of the projection output) is fine
  REJECTS(a.kv_c = make({4, 512}, DType::BFloat16, cuda0, {2112, 1});
          a.slots = make({4}, DType::Int32, cpu), "mla_rope_pool_fused expects all tensors on one device");
  REJECTS(a.has_cache = true;
          a.cos_sin_cache = make({100, 128}, DType::Float32),
          "cos_sin_cache must have shape [max_position, rotary_dim] = [*, 64], got torch.Size([100, 128])");
  REJECTS(a.has_cache = true; a.cos_sin_cache = make({100, 64}, DType::Float16),
                              "cos_sin_cache must be float32 or bfloat16, got torch.float16");
  REJECTS(a.has_cache = true; a.cos_sin_cache = make({100, 64}, DType::Float32, cuda0, {64, 2}),
                              "cos_sin_cache must be contiguous in its last dimension");
  REJECTS(a.rope_base = 0, "rope_base must be a positive number");
  REJECTS(a.q = make({4, 8192, 192}), "mla_rope_pool_fused supports heads * q.shape[2] <= 2^20, got 1572864");
  REJECTS(a.kv_cache = make({int64_t{1} << 22, 1024, 576}, DType::BFloat16, cuda0, {0, 0, 1}),
          "mla_rope_pool_fused supports paged caches of fewer than 2^32 slots, got 4294967296");
}

TEST_CASE("norm, scales, overlap: checks 24-36") {
  auto normed = [](DType wdt = DType::Float32, std::initializer_list<int64_t> shape = {512}) {
    MlaRopeArgs a = args();
    a.has_norm = true;
    a.kv_norm_weight = make(shape, wdt);
    return a;
  };
  check_mla_rope_pool(normed());
  check_mla_rope_pool(normed(DType::BFloat16));
  CHECK_THROWS_MSG(ValueError, check_mla_rope_pool(normed(DType::Float32, {576})),
                   "kv_norm_weight must have shape [kv_lora_rank] = [512], got torch.Size([576])");
  CHECK_THROWS_MSG(ValueError, check_mla_rope_pool(normed(DType::Float16)),
                   "kv_norm_weight must be float32 or kv_c's dtype (torch.bfloat16), got torch.float16");
  MlaRopeArgs strided = normed();
  strided.kv_norm_weight = make({512}, DType::Float32, cuda0, {2});
  CHECK_THROWS_MSG(ValueError, check_mla_rope_pool(strided), "kv_norm_weight must be contiguous");
  REJECTS(a.norm_eps = 0, "norm_eps must be a positive finite number, got 0");

  auto fp8 = [](DType cd = DType::Float8E4M3FN) {
    MlaRopeArgs a = args();
    a.kv_cache = make({8, 64, 576}, cd);
    a.has_cache_scale = true;
    a.cache_scale = make({}, DType::Float32);
    return a;
  };
  check_mla_rope_pool(fp8());
  check_mla_rope_pool(fp8(DType::Float8E5M2));
  MlaRopeArgs no_scale = fp8();
  no_scale.has_cache_scale = false;
  CHECK_THROWS_MSG(ValueError, check_mla_rope_pool(no_scale), "fp8 caches need cache_scale");
  REJECTS(a.has_cache_scale = true; a.cache_scale = make({}, DType::Float32),
                                    "cache_scale applies to fp8 caches only, got torch.bfloat16 caches");
  MlaRopeArgs f16 = fp8();
  f16.cache_scale = make({1}, DType::Float16);
  CHECK_THROWS_MSG(ValueError, check_mla_rope_pool(f16), "cache_scale and q_scale must be float32, got torch.float16");
  REJECTS(a.has_q_scale = true; a.q_scale = make({16}, DType::Float32),
                                "cache_scale and q_scale must have shape [] or [1], got torch.Size([16])");
  REJECTS(a.has_q_scale = true; a.q_scale = make({1}, DType::Float32);
          a.inplace = true, "q_scale needs inplace=False: q_rot is float8_e4m3fn");
  MlaRopeArgs on_mps = args(DType::BFloat16, mps);
  on_mps.kv_cache = make({8, 64, 576}, DType::Float8E4M3FN, mps);
  on_mps.has_cache_scale = true;
  on_mps.cache_scale = make({}, DType::Float32, mps);
  CHECK_THROWS_MSG(ValueError, check_mla_rope_pool(on_mps), "fp8 caches and fp8 q are supported on CUDA only");

  // what is written never aliases itself or what is read
  REJECTS(a.kv_cache = make({8, 64, 576}, DType::BFloat16, cuda0, {576, 0, 1}),
          "kv_cache and kpe_cache must not overlap each other or themselves");
  MlaRopeArgs shared = args();
  shared.kv_cache = make({8, 64, 512});
  shared.has_kpe_cache = true;
  shared.kpe_cache = make({8, 64, 64});
  shared.kpe_cache.data = shared.kv_cache.data;
  CHECK_THROWS_MSG(ValueError, check_mla_rope_pool(shared),
                   "kv_cache and kpe_cache must not overlap each other or themselves");
  const char* reads =
      "the caches must not overlap q, kv_c, k_pe, positions, slots, cos_sin_cache, kv_norm_weight or "
      "the scales";
  REJECTS(a.kv_c.data = a.kv_cache.data, reads);
  MlaRopeArgs weight = normed();
  weight.kv_norm_weight.data = weight.kv_cache.data;
  CHECK_THROWS_MSG(ValueError, check_mla_rope_pool(weight), reads);
  MlaRopeArgs in_place = args();
  in_place.inplace = true;
  check_mla_rope_pool(in_place);
  in_place.k_pe.data = static_cast<unsigned char*>(in_place.q.data) + 256;
  CHECK_THROWS_MSG(ValueError, check_mla_rope_pool(in_place),
                   "with inplace=True, q and k_pe must not overlap each other, themselves, kv_c, positions, slots, "
                   "cos_sin_cache, kv_norm_weight or the scales");
  // q and k_pe as slices of one projection output are read-only here: fine out of place
  MlaRopeArgs slices = args();
  slices.k_pe.data = slices.kv_c.data;
  check_mla_rope_pool(slices);
}

TEST_CASE("parameter block: geometry, 16-byte groups where everything allows, caches") {
  MlaRopeArgs a = args();
  const MlaRopeParams p = make_mla_rope_params(a, make({4, 16, 192}), make({4, 64}));
  CHECK_EQ(p.cache_slots, 512);
  CHECK_EQ(p.page_size, 64);
  CHECK_EQ(p.kv_stride_page, 64 * 576);
  CHECK_EQ(p.kv_stride_offset, 576);
  CHECK_EQ(p.kpe_stride_offset, 576);  // a combined cache: the same rows
  CHECK_EQ(p.heads, 16);
  CHECK_EQ(p.q_dim, 192);
  CHECK_EQ(p.rotary_dim, 64);
  CHECK_EQ(p.kv_rank, 512);
  CHECK_EQ(p.is_neox, 0);
  CHECK_EQ(p.width, 8);
  CHECK_EQ(p.norm_padded, 512);
  CHECK_EQ(p.use_cache, 0);
  CHECK(p.inv_freq[1] > 0.7f && p.inv_freq[1] < 0.8f);  // 10000^(-2/64)
  MlaRopeArgs flat = args(DType::Float32);
  flat.kv_cache = make({100, 576}, DType::Float32);
  flat.kv_c = make({4, 100}, DType::Float32);
  flat.kv_cache = make({100, 164}, DType::Float32);
  const MlaRopeParams f = make_mla_rope_params(flat, make({4, 16, 192}, DType::Float32), make({4, 64}, DType::Float32));
  CHECK_EQ(f.page_size, 1);
  CHECK_EQ(f.kv_stride_offset, 0);
  CHECK_EQ(f.norm_padded, 128);
  CHECK_EQ(f.width, 4);  // L = 100 holds whole float32 groups of 4
  MlaRopeArgs odd = args();
  odd.kv_c = make({4, 100});
  odd.kv_cache = make({8, 64, 164});
  CHECK_EQ(make_mla_rope_params(odd, odd.q, odd.k_pe).width, 1);  // 100 bf16 values: no 8-element groups
  MlaRopeArgs off = args();
  off.kv_c.data = static_cast<unsigned char*>(off.kv_c.data) + 2;
  CHECK_EQ(make_mla_rope_params(off, off.q, off.k_pe).width, 1);
  MlaRopeArgs fp8q = args();
  fp8q.has_q_scale = true;
  const MlaRopeParams q8 = make_mla_rope_params(fp8q, make({4, 16, 192}, DType::Float8E4M3FN), make({4, 64}));
  CHECK_EQ(q8.q_fp8, 1);
  CHECK_EQ(q8.width, 8);
  CHECK_EQ(mla_cache_slots(make({7, 576})), 7);
}

TEST_MAIN()
