// src/metal/rope_pool.metal (rope_pool and mla_rope_pool) and token_rms_norm.metal, unchanged, compiled as C++ and
// run over their dispatch grids by the emulator, against the CPU reference: f16/bf16/f32,
// head_dim 64/128/256, GQA and MHA, partial rotary, GPT-J, cos_sin_cache,
// slots -1 and out of range, duplicate slots reported as write conflicts, a
// padded grid, and the parameter block equal to the dispatcher's.
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>

#include "check.h"
#include "core/mla_rope_pool.h"
#include "core/rope_pool.h"
#include "core/token_rms_norm.h"
#include "cpu/float_bits.h"
#include "cpu/rope_pool_reference.h"
#include "tensor_builder.h"

// The shim's address-space macros (device, constant, ...) would clash with
// names in the headers above, so the emulator and the kernel come last.
#include "emulator.h"
#include "rope_pool.metal"       // the kernels under test, unchanged
#include "token_rms_norm.metal"  // (qk_norm_rope's per-token norm)
#undef device
#undef constant
#undef threadgroup
#undef kernel

using namespace attnprep;
using core::DType;
using core::TensorArg;
using emu::Tracked;

namespace {

const core::Device mps{core::DeviceType::MPS, 0};

// A host tensor: raw bits (read by the reference) and the emulator's Tracked
// copy (read and written by the kernel), same layout.
template <typename E>
struct Buffer {
  TensorArg arg;
  test::HostBuffer raw;
  std::vector<Tracked<E>> dev;

  size_t size = 0;  // elements of the tensor; dev has `guard` more after them

  void make(std::initializer_list<int64_t> shape, DType dt, uint32_t seed, std::initializer_list<int64_t> strides = {},
            size_t guard = 0) {
    arg = test::make(shape, dt, mps, strides);
    raw.attach(arg, seed);
    // replace random bits by random finite values of the dtype
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    const size_t n = (raw.bytes.size() - 16) / arg.itemsize;
    for (size_t i = 0; i < n; ++i) {
      unsigned char* p = raw.bytes.data() + i * arg.itemsize;
      const float x = normal(rng);
      if (dt == DType::Float16) {
        const uint16_t b = cpu::float_to_half(x);
        std::memcpy(p, &b, 2);
      } else if (dt == DType::BFloat16) {
        const uint16_t b = cpu::float_to_bf16(x);
        std::memcpy(p, &b, 2);
      } else
        std::memcpy(p, &x, 4);
    }
    size = n;
    dev.resize(n + guard);  // a guard region after the tensor: any store there is out of bounds
    for (size_t i = 0; i < n; ++i) std::memcpy(&dev[i].value, raw.bytes.data() + i * arg.itemsize, arg.itemsize);
  }
  bool guard_untouched() const {
    for (size_t i = size; i < dev.size(); ++i)
      if (dev[i].writer.load() >= 0) return false;
    return true;
  }
  float at(int64_t off) const { return static_cast<float>(dev[static_cast<size_t>(off)]); }
  bool written(int64_t off) const { return dev[static_cast<size_t>(off)].writer.load() >= 0; }
};

struct Case {
  DType dtype = DType::BFloat16;
  int64_t T = 17, hq = 8, hkv = 2, D = 64, rot = -1, pool = 40, pool_pad = 0;
  bool neox = true, cache = false, cache_bf16 = false, inplace = false, duplicate_slot = false;
  bool token_rows = false;     // positions=None: token t reads row t of a cache of T rows
  int mrope = 0;               // M-RoPE positions [3, T]: 1 sections, 2 interleaved
  bool strided_index = false;  // positions and slots every other entry of a larger buffer
  bool no_pool = false;        // no v, slots or pools (qk_norm_rope): the pool buffers must stay untouched
  int64_t page_size = 0;       // 0: a flat pool; else paged, `pool` slots in pages of this many
  bool hnd = false;            // paged layout: [pages, heads, page, D] instead of [pages, page, heads, D]
  bool empty_pages = false;    // paged, 3 pages of no slots (page_size 0): every slot is past the pool
  int64_t pad_groups = 0;
  int threads = 32;
  // QK norm: 0 none; 1 q and k, float32 weights, offset 0 (Qwen3); 2 k only,
  // weight in q's dtype, offset 1 (Gemma)
  int norm = 0;
};

double ulp_bound(DType dt, double ref, double partner) {
  const double f32 = 8 * std::ldexp(1.0, -24) * partner;
  if (dt == DType::Float32) return f32 + 8 * std::ldexp(1.0, -24) * std::fabs(ref);
  const int mant = dt == DType::Float16 ? 10 : 7;
  const double tiny = dt == DType::Float16 ? 6.103515625e-05 : 1.1754943508222875e-38;
  const double e = std::floor(std::log2(std::max(std::fabs(ref), tiny)));
  return std::ldexp(1.0, static_cast<int>(e) - mant) + f32;
}

template <typename E>
void run_case(const Case& c, uint32_t seed) {
  using Elem = Tracked<E>;
  const DType dt = c.dtype;
  constexpr DType elem_dtype = std::is_same_v<E, half>     ? DType::Float16
                               : std::is_same_v<E, bfloat> ? DType::BFloat16
                                                           : DType::Float32;
  if (dt != elem_dtype) {
    test::fail(__FILE__, __LINE__, "case dtype does not match the kernel's element type");
    return;
  }
  Buffer<E> q, k, v, kp, vp, qo, ko;
  q.make({c.T, c.hq, c.D}, dt, seed);
  k.make({c.T, c.hkv, c.D}, dt, seed + 1, {c.hkv * c.D * 2, c.D, 1});  // every other row of a larger buffer
  v.make({c.T, c.hkv, c.D}, dt, seed + 2);
  const int64_t prow = c.hkv * c.D + c.pool_pad;
  // slots up to pool + T occur: a guard of that many rows catches any store past the pool
  const size_t guard = static_cast<size_t>((c.T + 8) * prow);
  const int64_t P = c.page_size, pages = c.empty_pages ? 3 : P ? c.pool / P : 0;
  const int64_t page_stride = c.hnd ? c.hkv * P * c.D + c.pool_pad : P * prow;
  // element offset of (slot, head, d) in a pool, by layout
  auto pool_off = [&](int64_t slot, int64_t h, int64_t d) {
    if (!P) return slot * prow + h * c.D + d;
    const int64_t page = slot / P, o = slot % P;
    return page * page_stride + (c.hnd ? h * P * c.D + o * c.D : o * prow + h * c.D) + d;
  };
  for (Buffer<E>* pool : {&kp, &vp}) {
    const uint32_t s = seed + (pool == &kp ? 3 : 4);
    if (!P && !c.empty_pages)
      pool->make({c.pool, c.hkv, c.D}, dt, s, {prow, c.D, 1}, guard);
    else if (c.hnd)
      pool->make({pages, c.hkv, P, c.D}, dt, s, {page_stride, P * c.D, c.D, 1}, guard);
    else
      pool->make({pages, P, c.hkv, c.D}, dt, s, {page_stride, prow, c.D, 1}, guard);
  }
  qo.make({c.T, c.hq, c.D}, dt, seed + 5);
  ko.make({c.T, c.hkv, c.D}, dt, seed + 6);

  core::RopePoolArgs a;
  a.q = q.arg;
  a.k = k.arg;
  a.v = v.arg;
  a.k_pool = kp.arg;
  a.v_pool = vp.arg;
  a.head_dim = c.D;
  a.num_qo_heads = c.hq;
  a.num_kv_heads = c.hkv;
  if (c.rot >= 0) a.set_rotary_dim(c.rot);
  a.is_neox = c.neox;
  a.rope_base = 10000.0;
  a.kv_layout = c.hnd ? core::KvLayout::HND : core::KvLayout::NHD;
  // positions int64, slots int32: some negative, some past the pool
  const int64_t step = c.strided_index ? 2 : 1;
  std::vector<int64_t> positions(static_cast<size_t>(3 * c.T * step));
  std::vector<int32_t> slots(static_cast<size_t>(c.T * step));
  std::mt19937 rng(seed);
  std::vector<int32_t> perm(static_cast<size_t>(c.pool));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  const int64_t max_pos = c.cache ? 300 : (1 << 20);
  for (int64_t t = 0; t < c.T; ++t) {
    for (int64_t axis = 0; axis < 3; ++axis)
      positions[static_cast<size_t>((axis * c.T + t) * step)] = static_cast<int64_t>(rng() % max_pos);
    int32_t& slot = slots[static_cast<size_t>(t * step)];
    slot = t < c.pool ? perm[static_cast<size_t>(t)] : static_cast<int32_t>(t);
    if (t % 5 == 1) slot = -1;
    if (t % 7 == 3) slot = static_cast<int32_t>(c.pool + t);
  }
  if (c.duplicate_slot && c.T > 4) slots[static_cast<size_t>(4 * step)] = slots[0] = 7;
  a.positions = c.mrope ? test::make({3, c.T}, DType::Int64, mps) : test::make({c.T}, DType::Int64, mps);
  a.positions.strides[a.positions.ndim - 1] = step;
  if (c.mrope) a.positions.strides[0] = c.T * step;
  a.positions.data = positions.data();
  a.has_positions = !c.token_rows;
  a.slots = test::make({c.T}, DType::Int32, mps);
  a.slots.strides[0] = step;
  a.slots.data = slots.data();
  a.has_pool = !c.no_pool;
  if (c.mrope) {
    const int64_t half = (c.rot < 0 ? c.D : c.rot) / 2, hw = 3 * half / 8;  // Qwen2-VL's 16/24/24 of 64, scaled
    a.has_mrope_section = true;
    a.mrope_section = {half - 2 * hw, hw, hw};
    a.mrope_interleaved = c.mrope == 2;
  }
  Buffer<float> cache32;
  std::vector<uint16_t> cache16;
  const int64_t rot = c.rot < 0 ? c.D : c.rot;
  const int64_t rows = c.token_rows ? c.T : 300;
  if (c.cache) {
    cache32.make({rows, rot}, DType::Float32, seed + 7);
    auto* f = reinterpret_cast<float*>(cache32.raw.bytes.data());
    for (int64_t p = 0; p < rows; ++p)
      for (int64_t i = 0; i < rot / 2; ++i) {  // a scaled table: not what rope_base would give
        const double ang = p * std::pow(500000.0, -2.0 * i / rot) / 8.0;
        f[p * rot + i] = static_cast<float>(std::cos(ang));
        f[p * rot + rot / 2 + i] = static_cast<float>(std::sin(ang));
      }
    a.has_cache = true;
    a.cos_sin_cache = cache32.arg;
    if (c.cache_bf16) {
      cache16.resize(static_cast<size_t>(rows * rot));
      for (size_t i = 0; i < cache16.size(); ++i) cache16[i] = cpu::float_to_bf16(f[i]);
      a.cos_sin_cache = test::make({rows, rot}, DType::BFloat16, mps);
      a.cos_sin_cache.data = cache16.data();
    }
  }
  // norm weights: a float32 one (for q) and one in q's dtype (for k)
  Buffer<float> w32;
  Buffer<E> wT;
  w32.make({c.D}, DType::Float32, seed + 8);
  wT.make({c.D}, dt, seed + 9);
  if (c.norm == 1) {
    a.has_q_norm = a.has_k_norm = true;
    a.q_norm_weight = a.k_norm_weight = w32.arg;
  } else if (c.norm == 2) {
    a.has_k_norm = true;
    a.k_norm_weight = wT.arg;
    a.norm_offset = 1.0;
    a.norm_eps = 1e-5;
  }
  core::check_rope_pool(a);
  const TensorArg& q_rot_arg = c.inplace ? q.arg : qo.arg;
  const TensorArg& k_rot_arg = c.inplace ? k.arg : ko.arg;
  const core::MetalDispatch plan = core::plan_rope_pool_metal(a, q_rot_arg, k_rot_arg);

  const auto ref = cpu::rope_pool_reference(a);  // before the kernel: inplace overwrites q/k
  std::vector<float> cache_as_f32(c.cache && !c.cache_bf16 ? rows * rot : 1);
  if (c.cache && !c.cache_bf16) std::memcpy(cache_as_f32.data(), cache32.raw.bytes.data(), cache_as_f32.size() * 4);

  // the weights as the kernel's float32 buffers see them (used when a weight is float32)
  const void* q_w32 = a.has_q_norm ? a.q_norm_weight.data : w32.raw.bytes.data();
  const void* k_w32 = a.has_k_norm ? a.k_norm_weight.data : w32.raw.bytes.data();
  emu::write_conflicts = 0;
  RopePoolParams fed = plan.params;  // what the emulator hands the kernel
  Elem* q_out = c.inplace ? q.dev.data() : qo.dev.data();
  Elem* k_out = c.inplace ? k.dev.data() : ko.dev.data();
  emu::dispatch(plan.threadgroups + c.pad_groups, c.threads, seed, [&](uint g, uint lane, uint n) {
    rope_pool<Elem>(q.dev.data(), k.dev.data(), v.dev.data(), q_out, k_out, kp.dev.data(), vp.dev.data(),
                    c.token_rows ? nullptr : reinterpret_cast<const int*>(positions.data()),
                    reinterpret_cast<const int*>(slots.data()), cache_as_f32.data(),
                    cache16.empty() ? nullptr : cache16.data(), fed, static_cast<const float*>(q_w32), wT.dev.data(),
                    static_cast<const float*>(k_w32), wT.dev.data(), g, lane, n);
  });
  CHECK(std::memcmp(&fed, &plan.params, sizeof(fed)) == 0);

  const std::string what = std::string(core::dtype_name(dt)) + " T=" + std::to_string(c.T) +
                           " D=" + std::to_string(c.D) + " rot=" + std::to_string(rot) + (c.neox ? " neox" : " gptj") +
                           (c.cache ? " cache" : "") + (c.mrope ? " mrope" + std::to_string(c.mrope) : "") +
                           (c.norm ? " norm" + std::to_string(c.norm) : "") +
                           (P || c.empty_pages ? (c.hnd ? " HND page " : " NHD page ") + std::to_string(P) : "");
  // q_rot / k_rot against the reference
  // `rotated`: the reference's rotation inputs (normalized heads where asked)
  auto compare = [&](const std::vector<double>& want, const Elem* got, const TensorArg& layout,
                     const std::vector<float>& rotated, int64_t heads) {
    double worst = 0;
    for (int64_t t = 0; t < c.T; ++t)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < c.D; ++d) {
          const double w = want[static_cast<size_t>((t * heads + h) * c.D + d)];
          const double g = static_cast<float>(got[t * layout.strides[0] + h * layout.strides[1] + d]);
          if (std::isnan(w)) {
            if (!std::isnan(g)) worst = 1e9;
            continue;
          }
          int64_t pd = d;  // the element paired with d in its rotation
          if (d < rot) pd = c.neox ? (d < rot / 2 ? d + rot / 2 : d - rot / 2) : (d ^ 1);
          const float* row = &rotated[static_cast<size_t>((t * heads + h) * c.D)];
          const double partner = std::fabs(row[d]) + std::fabs(row[pd]);
          worst = std::max(worst, std::fabs(g - w) / ulp_bound(dt, w, partner));
        }
    return worst;
  };
  const double wq = compare(ref.q_rot, q_out, q_rot_arg, ref.q_in, c.hq);
  const double wk = compare(ref.k_rot, k_out, k_rot_arg, ref.k_in, c.hkv);
  if (!(wq <= 1.0 && wk <= 1.0))
    test::fail(__FILE__, __LINE__, what + ": error " + std::to_string(std::max(wq, wk)) + "x bound");

  // pools: the rows the reference writes hold exactly this kernel's k_rot and v; all others untouched
  bool pools_ok = true;
  for (int64_t s = 0; s < c.pool; ++s) {
    const int64_t tok = c.no_pool ? -1 : ref.pool_writer[static_cast<size_t>(s)];
    for (int64_t h = 0; h < c.hkv; ++h)
      for (int64_t d = 0; d < c.D; ++d) {
        const int64_t off = pool_off(s, h, d);
        if (tok < 0 || (c.duplicate_slot && s == 7)) {
          if (tok < 0) pools_ok &= !kp.written(off) && !vp.written(off);
          continue;
        }
        const float kr = static_cast<float>(k_out[tok * k_rot_arg.strides[0] + h * k_rot_arg.strides[1] + d]);
        const float vv = v.at(tok * v.arg.strides[0] + h * v.arg.strides[1] + d);
        pools_ok &= std::memcmp(&kr, &kp.dev[static_cast<size_t>(off)], 0) == 0 &&
                    static_cast<float>(kp.dev[static_cast<size_t>(off)]) == kr &&
                    static_cast<float>(vp.dev[static_cast<size_t>(off)]) == vv;
      }
    for (int64_t e = c.hkv * c.D; !P && e < prow && s + 1 < c.pool; ++e)  // the padding between rows: never written
      pools_ok &= !kp.written(s * prow + e) && !vp.written(s * prow + e);
  }
  if (!pools_ok) test::fail(__FILE__, __LINE__, what + ": pool rows differ or were written outside the slots");
  if (!kp.guard_untouched() || !vp.guard_untouched())
    test::fail(__FILE__, __LINE__, what + ": a store landed past the end of a pool");
  if (c.duplicate_slot)
    CHECK(emu::write_conflicts.load() > 0);
  else if (emu::write_conflicts.load() != 0)
    test::fail(__FILE__, __LINE__, what + ": " + std::to_string(emu::write_conflicts.load()) + " write conflicts");
}

template <typename E>
void run_matrix(DType dt, uint32_t& seed) {
  for (int64_t D : {64, 128, 256})
    for (auto heads : {std::pair<int64_t, int64_t>{8, 2}, {4, 4}}) {
      Case c;
      c.dtype = dt;
      c.D = D;
      c.hq = heads.first;
      c.hkv = heads.second;
      c.T = D == 256 ? 5 : 13;
      run_case<E>(c, seed++);
    }
}

}  // namespace

TEST_CASE("emulated Metal kernel: f16/bf16/f32 x head_dim 64/128/256 x GQA/MHA") {
  uint32_t seed = 1;
  run_matrix<half>(DType::Float16, seed);
  run_matrix<bfloat>(DType::BFloat16, seed);
  run_matrix<float>(DType::Float32, seed);
}

TEST_CASE("emulated Metal kernel: partial rotary, GPT-J, cos_sin_cache, inplace, row-strided pools") {
  uint32_t seed = 100;
  for (bool neox : {true, false})
    for (int64_t rot : {int64_t{-1}, int64_t{32}, int64_t{6}}) {
      Case c;
      c.neox = neox;
      c.rot = rot;
      c.pool_pad = 24;
      run_case<bfloat>(c, seed++);
    }
  for (bool bf16 : {false, true}) {
    Case c;
    c.cache = true;
    c.cache_bf16 = bf16;
    c.dtype = DType::Float32;
    run_case<float>(c, seed++);
    c.neox = false;
    c.rot = 32;
    run_case<float>(c, seed++);
  }
  Case c;
  c.inplace = true;
  c.dtype = DType::Float16;
  run_case<half>(c, seed++);
}

TEST_CASE("emulated Metal kernel: per-token cos/sin (positions=None), float32 and bfloat16 rows, with the QK norm") {
  uint32_t seed = 150;
  for (bool bf16 : {false, true})
    for (int norm : {0, 1}) {
      Case c;
      c.cache = c.token_rows = true;
      c.cache_bf16 = bf16;
      c.norm = norm;
      c.neox = !bf16;
      run_case<bfloat>(c, seed++);
    }
}

TEST_CASE("emulated Metal kernel: M-RoPE (sections and interleaved), strided positions and slots") {
  uint32_t seed = 170;
  for (int mrope : {0, 1, 2})
    for (bool cache : {false, true}) {
      Case c;
      c.mrope = mrope;
      c.strided_index = true;
      c.cache = cache;
      c.neox = mrope != 2;
      c.rot = mrope == 1 ? 48 : -1;
      c.norm = cache ? 1 : 0;
      run_case<bfloat>(c, seed++);
    }
}

TEST_CASE("emulated Metal kernel: no cache write (qk_norm_rope), with the QK norm and M-RoPE") {
  uint32_t seed = 190;
  for (int norm : {0, 1}) {
    Case c;
    c.no_pool = true;
    c.norm = norm;
    c.mrope = norm ? 2 : 0;
    c.cache = norm == 1;
    c.dtype = DType::Float16;
    run_case<half>(c, seed++);
  }
}

TEST_CASE("emulated Metal kernel: paged pools, NHD and HND, pages of 1, 4 and 16 slots, padded pages") {
  uint32_t seed = 300;
  for (bool hnd : {false, true})
    for (int64_t page : {int64_t{1}, int64_t{4}, int64_t{16}}) {
      Case c;
      c.page_size = page;
      c.hnd = hnd;
      c.pool = 48;  // whole pages; slots past it and negative ones still occur
      c.pool_pad = page == 4 ? 40 : 0;
      run_case<bfloat>(c, seed++);
      c.dtype = DType::Float32;
      c.T = 29;
      run_case<float>(c, seed++);
    }
}

TEST_CASE("emulated Metal kernel: paged pools of empty pages (page_size 0) rotate q and k and write nothing") {
  uint32_t seed = 320;
  for (bool hnd : {false, true}) {
    Case c;
    c.empty_pages = true;
    c.hnd = hnd;
    c.pool = 0;
    run_case<bfloat>(c, seed++);
  }
}

TEST_CASE("emulated Metal kernel: padded grid, a group size of 64, duplicate slots are write conflicts") {
  uint32_t seed = 200;
  Case c;
  c.pad_groups = 3;
  run_case<bfloat>(c, seed++);
  Case c64;
  c64.threads = 64;
  run_case<bfloat>(c64, seed++);
  Case d;
  d.duplicate_slot = true;
  d.dtype = DType::Float16;
  run_case<half>(d, seed++);
}

TEST_CASE("emulated Metal kernel: QK norm (Qwen3 and Gemma styles), with partial rotary, GPT-J, paged, inplace") {
  uint32_t seed = 400;
  for (int norm : {1, 2})
    for (bool neox : {true, false}) {
      Case c;
      c.norm = norm;
      c.neox = neox;
      run_case<bfloat>(c, seed++);
      c.rot = 32;
      c.dtype = DType::Float32;
      c.D = 80;  // not a power of two: the pairwise sum pads
      run_case<float>(c, seed++);
    }
  Case c;
  c.norm = 1;
  c.inplace = true;
  c.page_size = 4;
  c.pool = 48;
  c.dtype = DType::Float16;
  c.hq = 300;  // more q/k heads than one chunk of norm factors
  c.hkv = 2;
  c.T = 3;
  run_case<half>(c, seed++);
}

// qk_norm_rope's per-token norm over a [T, heads, head_dim] view with a row stride past the heads, into a
// contiguous output: bit for bit the C++ reference, every element written once, nothing past the output.
template <typename E>
void run_token_norm(DType dt, int64_t T, int64_t heads, int64_t D, bool w_f32, double offset, uint32_t seed) {
  Buffer<E> x, out, wT;
  Buffer<float> w32;
  x.make({T, heads, D}, dt, seed, {heads * D + 8, D, 1});
  out.make({T, heads, D}, dt, seed + 1, {}, static_cast<size_t>(heads * D));
  w32.make({heads * D}, DType::Float32, seed + 2);
  wT.make({heads * D}, dt, seed + 3);
  core::TokenNormArgs a;
  a.x = x.arg;
  a.out = out.arg;
  a.weight = w_f32 ? w32.arg : wT.arg;
  a.eps = 1e-5;
  a.offset = offset;
  core::check_token_rms_norm(a);
  const core::TokenNormMetalDispatch plan = core::plan_token_rms_norm_metal(a);
  std::vector<float> w32_values(static_cast<size_t>(heads * D));
  std::memcpy(w32_values.data(), w32.raw.bytes.data(), w32_values.size() * 4);
  emu::write_conflicts = 0;
  TokenNormParams fed = plan.params;  // what the emulator hands the kernel
  emu::dispatch(plan.threadgroups + 1, plan.threads_per_group, seed, [&](uint g, uint lane, uint n) {
    token_rms_norm<Tracked<E>>(x.dev.data(), w32_values.data(), wT.dev.data(), out.dev.data(), fed, g, lane, n);
  });
  bool exact = true;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> row(static_cast<size_t>(heads * D));
    for (int64_t e = 0; e < heads * D; ++e) row[static_cast<size_t>(e)] = x.at(t * (heads * D + 8) + e);
    const std::vector<float> want = cpu::rms_norm_head(row, a.weight, dt, a.eps, a.offset);
    for (int64_t e = 0; e < heads * D; ++e) exact &= out.at(t * heads * D + e) == want[static_cast<size_t>(e)];
  }
  const std::string what = std::string(core::dtype_name(dt)) + " T=" + std::to_string(T) +
                           " heads=" + std::to_string(heads) + " D=" + std::to_string(D);
  if (!exact) test::fail(__FILE__, __LINE__, what + ": differs from the reference");
  if (!out.guard_untouched()) test::fail(__FILE__, __LINE__, what + ": a store landed past the output");
  if (emu::write_conflicts.load() != 0) test::fail(__FILE__, __LINE__, what + ": write conflicts");
}

TEST_CASE("emulated Metal kernel: qk_norm_rope's per-token norm, bit for bit the reference") {
  uint32_t seed = 210;
  run_token_norm<bfloat>(DType::BFloat16, 3, 12, 128, true, 0.0, seed++);   // a run of 8 per thread
  run_token_norm<half>(DType::Float16, 2, 3, 96, false, 1.0, seed++);       // 288 of 512 padded
  run_token_norm<float>(DType::Float32, 2, 2, 64, true, 0.0, seed++);       // fewer runs than threads
  run_token_norm<bfloat>(DType::BFloat16, 1, 40, 128, false, 1.0, seed++);  // Wan 14B's 40 heads
}

// mla_rope_pool_fused's kernel: q [T, heads, nope + R], kv_c and k_pe slices of one [T, L + R + 8] projection output,
// a paged combined cache or separate ones: the rotated values within the bound of the float64 reference, q's other
// elements and the latent bit for bit, each slot's row written by its token alone, nothing past the caches.
struct MlaCase {
  DType dtype = DType::BFloat16;
  int64_t T = 9, heads = 4, nope = 16, R = 32, L = 64;
  bool neox = false, separate = false, inplace = false, norm = true, table = false;
};

template <typename E>
void run_mla(const MlaCase& c, uint32_t seed) {
  using Elem = Tracked<E>;
  const DType dt = c.dtype;
  const int64_t row = c.L + c.R + 8, P = 4, pages = 6, width = c.separate ? c.L : c.L + c.R;
  Buffer<E> q, kv, qo, peo, cache, kpe, wT;
  Buffer<float> w32, table;
  q.make({c.T, c.heads, c.nope + c.R}, dt, seed);
  kv.make({c.T, row}, dt, seed + 1);
  qo.make({c.T, c.heads, c.nope + c.R}, dt, seed + 2);
  peo.make({c.T, c.R}, dt, seed + 3);
  cache.make({pages, P, width}, dt, seed + 4, {}, static_cast<size_t>(4 * width));
  kpe.make({pages, P, c.R}, dt, seed + 5, {}, static_cast<size_t>(4 * c.R));
  w32.make({c.L}, DType::Float32, seed + 6);
  wT.make({c.L}, dt, seed + 7);
  table.make({300, c.R}, DType::Float32, seed + 8);  // any finite values: the table is read as given
  core::MlaRopeArgs a;
  a.q = q.arg;
  a.kv_c = test::make({c.T, c.L}, dt, mps, {row, 1});
  a.kv_c.data = kv.arg.data;
  a.k_pe = test::make({c.T, c.R}, dt, mps, {row, 1});
  a.k_pe.data = static_cast<unsigned char*>(kv.arg.data) + c.L * kv.arg.itemsize;
  a.kv_cache = cache.arg;
  a.has_kpe_cache = c.separate;
  a.kpe_cache = kpe.arg;
  a.is_neox = c.neox;
  a.inplace = c.inplace;
  a.has_norm = c.norm;
  a.kv_norm_weight = seed % 2 ? w32.arg : wT.arg;
  a.has_cache = c.table;
  a.cos_sin_cache = table.arg;
  std::vector<int64_t> positions(static_cast<size_t>(c.T));
  std::vector<int32_t> slots(static_cast<size_t>(c.T));
  std::mt19937 rng(seed);
  for (int64_t t = 0; t < c.T; ++t) {
    positions[static_cast<size_t>(t)] = t == 2 && c.table ? 300 : static_cast<int64_t>(rng() % 300);  // 300: outside
    slots[static_cast<size_t>(t)] = t % 4 == 1   ? -1
                                    : t % 5 == 3 ? static_cast<int32_t>(P * pages + t)
                                                 : static_cast<int32_t>((7 * t + 3) % (P * pages));
  }
  a.positions = test::make({c.T}, DType::Int64, mps);
  a.positions.data = positions.data();
  a.slots = test::make({c.T}, DType::Int32, mps);
  a.slots.data = slots.data();
  core::check_mla_rope_pool(a);
  const TensorArg q_rot_arg = c.inplace ? a.q : qo.arg, pe_rot_arg = c.inplace ? a.k_pe : peo.arg;
  const core::MlaMetalDispatch plan = core::plan_mla_rope_pool_metal(a, q_rot_arg, pe_rot_arg);
  const cpu::MlaReference ref = cpu::mla_rope_pool_reference(a);  // before the kernel: inplace overwrites q, k_pe
  std::vector<float> q_in(q.size);
  for (size_t i = 0; i < q.size; ++i) q_in[i] = q.at(static_cast<int64_t>(i));
  std::vector<float> w(static_cast<size_t>(c.L)), tab(static_cast<size_t>(300 * c.R));
  // the kernel's float32 weight buffer: the given weight where it is float32
  const void* w_f32 = a.kv_norm_weight.dtype == DType::Float32 ? a.kv_norm_weight.data : w32.raw.bytes.data();
  std::memcpy(w.data(), w_f32, w.size() * 4);
  std::memcpy(tab.data(), table.raw.bytes.data(), tab.size() * 4);
  emu::write_conflicts = 0;
  MlaRopeParams fed = plan.params;
  Elem* q_out = c.inplace ? q.dev.data() : qo.dev.data();
  Elem* pe_out = c.inplace ? kv.dev.data() + c.L : peo.dev.data();
  emu::dispatch(plan.threadgroups + 1, 32, seed, [&](uint g, uint lane, uint n) {
    mla_rope_pool<Elem>(q.dev.data(), kv.dev.data(), kv.dev.data() + c.L, q_out, pe_out, cache.dev.data(),
                        c.separate ? kpe.dev.data() : cache.dev.data() + c.L,
                        reinterpret_cast<const int*>(positions.data()), slots.data(), tab.data(), nullptr, fed,
                        w.data(), wT.dev.data(), g, lane, n);
  });
  const std::string what = std::string(core::dtype_name(dt)) + (c.neox ? " neox" : " gptj") +
                           (c.separate ? " separate" : " combined") + (c.inplace ? " inplace" : "") +
                           (c.norm ? " norm" : "") + (c.table ? " table" : "") + " L=" + std::to_string(c.L);
  // the rotated parts: within the bound of float64, NaN where the position is outside the table
  double worst = 0;
  const int64_t half = c.R / 2, q_dim = c.nope + c.R;
  auto check_rotated = [&](double want, double got, double x, double partner_x) {
    if (std::isnan(want)) {
      if (!std::isnan(got)) worst = 1e9;
      return;
    }
    worst = std::max(worst, std::fabs(got - want) / ulp_bound(dt, want, std::fabs(x) + std::fabs(partner_x)));
  };
  bool exact = true;
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t d = 0; d < c.R; ++d) {
      const int64_t pd = c.neox ? (d < half ? d + half : d - half) : (d ^ 1);
      for (int64_t h = 0; h < c.heads; ++h) {
        const size_t at = static_cast<size_t>((t * c.heads + h) * c.R + d);
        const float* in = &ref.rope.q_in[static_cast<size_t>((t * c.heads + h) * c.R)];
        check_rotated(ref.rope.q_rot[at],
                      static_cast<float>(q_out[t * q_rot_arg.strides[0] + h * q_rot_arg.strides[1] + c.nope + d]),
                      in[d], in[pd]);
      }
      const float* in = &ref.rope.k_in[static_cast<size_t>(t * c.R)];
      check_rotated(ref.rope.k_rot[static_cast<size_t>(t * c.R + d)],
                    static_cast<float>(pe_out[t * pe_rot_arg.strides[0] + d]), in[d], in[pd]);
    }
  for (int64_t t = 0; t < c.T; ++t)  // q's other elements: copied, or left where they are
    for (int64_t h = 0; h < c.heads; ++h)
      for (int64_t e = 0; e < c.nope; ++e)
        exact &= static_cast<float>(q_out[t * q_rot_arg.strides[0] + h * q_rot_arg.strides[1] + e]) ==
                 q_in[static_cast<size_t>((t * c.heads + h) * q_dim + e)];
  if (!(worst <= 1.0)) test::fail(__FILE__, __LINE__, what + ": error " + std::to_string(worst) + "x bound");
  // the cache rows: the writer's latent and rotated k_pe, bit for bit; other rows untouched
  bool rows_ok = true;
  for (int64_t s = 0; s < P * pages; ++s) {
    const int64_t tok = ref.cache_writer[static_cast<size_t>(s)];
    for (int64_t e = 0; e < c.L + c.R; ++e) {
      const bool latent = e < c.L;
      const Buffer<E>& buf = latent || !c.separate ? cache : kpe;
      const int64_t off = latent || !c.separate ? s * width + e : s * c.R + e - c.L;
      if (tok < 0) {
        rows_ok &= !buf.written(off);
        continue;
      }
      const float want = latent ? ref.latent[static_cast<size_t>(tok * c.L + e)]
                                : static_cast<float>(pe_out[tok * pe_rot_arg.strides[0] + e - c.L]);
      rows_ok &= buf.at(off) == want;
    }
  }
  if (!exact || !rows_ok) test::fail(__FILE__, __LINE__, what + ": copied values or cache rows differ");
  if (!cache.guard_untouched() || !kpe.guard_untouched())
    test::fail(__FILE__, __LINE__, what + ": a store landed past a cache");
  if (emu::write_conflicts.load() != 0) test::fail(__FILE__, __LINE__, what + ": write conflicts");
}

TEST_CASE("emulated Metal kernel: mla_rope_pool, GPT-J and NeoX, combined and separate caches, in place, tables") {
  uint32_t seed = 300;
  for (bool neox : {false, true})
    for (bool separate : {false, true})
      for (bool inplace : {false, true}) {
        MlaCase c;
        c.neox = neox;
        c.separate = separate;
        c.inplace = inplace;
        c.table = inplace;
        run_mla<bfloat>(c, seed++);
      }
  MlaCase odd;  // a rank of no power of two, no norm, float16; float32 with 128 heads of 0 + 64
  odd.dtype = DType::Float16;
  odd.L = 100;
  odd.norm = false;
  run_mla<half>(odd, seed++);
  odd.L = 100;
  odd.norm = true;
  run_mla<half>(odd, seed++);
  MlaCase wide;
  wide.dtype = DType::Float32;
  wide.heads = 128;
  wide.nope = 0;
  wide.R = 64;
  wide.L = 512;
  wide.T = 3;
  run_mla<float>(wide, seed++);
}

TEST_CASE("the dispatcher's parameter block: strides, flags, table") {
  core::RopePoolArgs a;
  a.q = test::make({4, 8, 64}, DType::Float16, mps, {12 * 64, 64, 1});
  a.k = test::make({4, 2, 64}, DType::Float16, mps);
  a.v = a.k;
  a.positions = test::make({4}, DType::Int32, mps);
  a.slots = test::make({4}, DType::Int64, mps);
  a.k_pool = test::make({9, 2, 64}, DType::Float16, mps, {3 * 128, 64, 1});
  a.v_pool = test::make({9, 2, 64}, DType::Float16, mps, {2 * 128, 64, 1});
  a.head_dim = 64;
  a.num_qo_heads = 8;
  a.num_kv_heads = 2;
  a.rope_base = 500000.0;
  a.is_neox = false;
  core::check_rope_pool(a);
  const auto d = core::plan_rope_pool_metal(a, a.q, a.k);
  CHECK_EQ(d.threadgroups, int64_t{4});
  CHECK_EQ(d.params.q_stride_token, int64_t{12 * 64});
  CHECK_EQ(d.params.kp_stride_page, int64_t{3 * 128});
  CHECK_EQ(d.params.vp_stride_page, int64_t{2 * 128});
  CHECK_EQ(d.params.pool_size, int64_t{9});
  CHECK_EQ(d.params.positions_kind, 0);
  CHECK_EQ(d.params.slots_int64, 1);
  CHECK_EQ(d.params.is_neox, 0);
  CHECK_EQ(d.params.inv_freq[5], static_cast<float>(1.0 / std::pow(500000.0, 10.0 / 64)));
}

TEST_MAIN()
