// Random arguments, valid and hostile, through the ops' checks and, where the
// checks pass, the host plans the bindings then build. The only outcomes
// allowed: a pass, or a ValueError whose text is one of the op's documented
// messages (docs/contract.md) with its numbers in range. Sizes, strides and
// addresses keep what torch guarantees of a tensor it hands over (the model
// is in `legalize`), extreme values included: empty tensors of huge
// dimensions, expanded (stride 0) dimensions, any stride on a size-1
// dimension, tensors without an address. Built with
// -fsanitize=address,undefined (tools/host_sanitize.sh) the same cases also
// show any overflow or out-of-bounds read in the checks. (GCC and Clang: the
// model of torch's tensors uses their overflow builtins and __int128.)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "core/errors.h"
#include "core/mla_rope_pool.h"
#include "core/overlap.h"
#include "core/pack_qkv.h"
#include "core/rope_pool.h"
#include "core/usp_merge_heads.h"
#include "tensor_builder.h"

using namespace attnprep::core;
using test::make;

namespace {

constexpr int kRounds = 40000;
constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

struct Rng {
  std::mt19937_64 g;
  explicit Rng(uint64_t seed) : g(seed) {}
  uint64_t below(uint64_t n) { return g() % n; }
  bool chance(int percent) { return below(100) < static_cast<uint64_t>(percent); }
  template <class T>
  T of(std::initializer_list<T> values) {
    return values.begin()[below(values.size())];
  }
  int64_t size() {
    return of<int64_t>({0,
                        1,
                        2,
                        3,
                        7,
                        17,
                        65,
                        128,
                        513,
                        65535,
                        65536,
                        70000,
                        (int64_t{1} << 31) - 1,
                        int64_t{1} << 31,
                        (int64_t{1} << 32) - 1,
                        int64_t{1} << 32,
                        int64_t{1} << 40,
                        int64_t{1} << 61,
                        int64_t{1} << 62,
                        kMax});
  }
  int64_t stride() {
    return of<int64_t>({0, 1, 2, 3, 8, 64, 4096, -1, -64, int64_t{1} << 31, int64_t{1} << 40, int64_t{1} << 62, kMax,
                        -(int64_t{1} << 62)});
  }
  DType dtype() {  // any dtype of torch's (Other, newer than the build, prints as "unknown dtype")
    return static_cast<DType>(below(static_cast<uint64_t>(DType::Other)));
  }
  Device device() {
    return of<Device>({{DeviceType::CUDA, 0},
                       {DeviceType::CUDA, 0},
                       {DeviceType::CUDA, 1},
                       {DeviceType::CPU, 0},
                       {DeviceType::MPS, 0},
                       {DeviceType::Other, 0}});
  }
};

// Sizes past the 8 dimensions a TensorArg holds (the binding lends the
// tensor's own), for tensors of up to 10 dimensions.
const int64_t kWideShape[10] = {2, 3, 4, 5, 6, 7, 8, 9, 10, 11};

// What torch guarantees: sizes >= 0 whose product fits in int64 unless one
// is 0, no negative strides, and a tensor with an address and elements
// spans memory that exists (under 2^47 bytes); any stride where a dimension
// has one index, any size where its stride is 0 (expand).
void legalize(TensorArg& t) {
  if (t.ndim > kMaxDims) {
    t.full_shape = kWideShape;
    return;
  }
  bool empty = false;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0) t.shape[d] = 0;
    if (t.strides[d] < 0) t.strides[d] = t.strides[d] == std::numeric_limits<int64_t>::min() ? 0 : -t.strides[d];
    empty = empty || t.shape[d] == 0;
  }
  if (empty) return;
  for (int d = 0; d < t.ndim; ++d) {
    int64_t prod = 1;
    bool over = false;
    for (int e = 0; e <= d; ++e) over = over || __builtin_mul_overflow(prod, t.shape[e], &prod);
    if (over) t.shape[d] = 1;
  }
  if (!t.has_address) return;
  __int128 span = t.itemsize;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] <= 1 || t.strides[d] == 0) continue;
    const bool huge = t.strides[d] > (int64_t{1} << 47) || t.shape[d] > (int64_t{1} << 47);
    const __int128 reach = huge ? 0 : static_cast<__int128>(t.strides[d]) * (t.shape[d] - 1) * t.itemsize;
    if (huge || span + reach > (__int128{1} << 47))
      t.strides[d] = 0;  // as expand makes it
    else
      span += reach;
  }
}

// One random change to a tensor; `others` lend addresses to alias.
void mutate(Rng& r, TensorArg& t, const std::vector<const TensorArg*>& others) {
  switch (r.below(9)) {
    case 0:
      t.ndim = static_cast<int32_t>(r.below(11));
      break;
    case 1:
      if (t.ndim > 0 && t.ndim <= kMaxDims) t.shape[r.below(t.ndim)] = r.size();
      break;
    case 2:
      if (t.ndim > 0 && t.ndim <= kMaxDims) t.strides[r.below(t.ndim)] = r.stride();
      break;
    case 3:
      t.dtype = r.dtype();
      t.itemsize = test::itemsize_of(t.dtype);
      break;
    case 4:
      t.device = r.device();
      break;
    case 5: {
      const TensorArg* o = others[r.below(others.size())];
      t.data = static_cast<unsigned char*>(o->data) + r.of<int64_t>({0, 1, 2, 16, 128, 4096});
      break;
    }
    case 6:
      t.data = static_cast<unsigned char*>(t.data) + r.of<int64_t>({1, 2, 4, 8});
      break;
    case 7:
      t.has_address = false;
      break;
    default:
      if (t.ndim > 0 && t.ndim <= kMaxDims) t.strides[t.ndim - 1] = r.stride();
      break;
  }
  legalize(t);
}

// The message is `prefix` followed by a decimal integer (of up to 39
// digits: a product of two sizes) of at least `floor`.
bool number_after(const std::string& m, const std::string& prefix, int64_t floor) {
  if (m.compare(0, prefix.size(), prefix) != 0) return false;
  const std::string rest = m.substr(prefix.size());
  if (rest.empty() || rest.size() > 39 || rest.find_first_not_of("0123456789") != std::string::npos ||
      (rest.size() > 1 && rest[0] == '0'))
    return false;
  return rest.size() > 19 || std::strtoull(rest.c_str(), nullptr, 10) >= static_cast<uint64_t>(floor);
}

bool starts(const std::string& m, const char* prefix) { return m.rfind(prefix, 0) == 0; }

// docs/contract.md, rope_pool_fused's checks 1-47 (40, per-token rows, is not reached: positions stay given).
bool rope_message(const std::string& m) {
  static const char* exact[] = {
      "rope_pool_fused expects q/k/v to be 3-D",
      "rope_pool_fused expects positions/slots to be 1-D",
      "rope_pool_fused expects pool tensors to be 3-D",
      "positions/slots must have one entry per token",
      "q/k/v dtypes must match",
      "pool dtypes must match q/k/v dtype",
      "rope_pool_fused expects all tensors on one device",
      "rope_pool_fused expects CUDA or MPS tensors",
      "rope_pool_fused expects int32 or int64 positions/slots",
      "rope_pool_fused expects q, k, v and the pools to be contiguous in head_dim",
      "cos_sin_cache must be contiguous in its last dimension",
      "rope_base must be a positive number",
      "k_pool and v_pool must not overlap each other or themselves",
      "k_pool and v_pool must not overlap q, k, v, positions, slots, cos_sin_cache or the scales",
      "with inplace=True, q and k must not overlap each other, themselves, v, positions, slots, cos_sin_cache or "
      "the scales",
      "fp8 pools need k_scale and v_scale",
      "fp8 pools are supported on CUDA only",
      "q_norm_weight and k_norm_weight must be contiguous",
      "k_pool and v_pool (and q and k with inplace=True) must not overlap q_norm_weight or k_norm_weight",
      "k_scale and v_scale apply to fp8 pools only, got no pools",
      "mrope_interleaved=True needs mrope_section",
      "q_scale needs inplace=False: q_rot is float8_e4m3fn",
      "fp8 q is supported on CUDA only",
  };
  for (const char* e : exact)
    if (m == e) return true;
  static const char* prefixed[] = {
      "q shape must be [num_tokens, num_qo_heads, head_dim], got torch.Size([",
      "k shape must be [num_tokens, num_kv_heads, head_dim], got torch.Size([",
      "v shape must match k shape, got torch.Size([",
      "k_pool has incompatible shape torch.Size([",
      "v_pool shape must match k_pool shape, got torch.Size([",
      "rope_pool_fused supports float16, bfloat16 and float32, got torch.",
      "rope_pool_fused expects an even head_dim in [2, 512], got ",
      "rope_pool_fused expects an even rotary_dim in [2, head_dim], got ",
      "cos_sin_cache must have shape [max_position, rotary_dim] = [*, ",
      "cos_sin_cache must be float32 or bfloat16, got torch.",
      "k_scale and v_scale apply to fp8 pools only, got torch.",
      "k_scale and v_scale must be float32, got torch.",
      "k_scale and v_scale must have shape [], [1] or [num_kv_heads] (contiguous), got torch.Size([",
      "q_norm_weight and k_norm_weight must have shape [head_dim] = [",
      "q_norm_weight and k_norm_weight must be float32 or q's dtype (torch.",
      "norm_eps must be a positive finite number, got ",
      "norm_weight_offset must be finite, got ",
      "mrope_section must be three non-negative integers summing to rotary_dim / 2 = ",
      "M-RoPE positions must have shape [3, num_tokens] = [3, ",
      "q_scale must be float32, got torch.",
      "q_scale must have shape [] or [1], got torch.Size([",
  };
  for (const char* p : prefixed)
    if (starts(m, p)) return true;
  // the limits print the offending count, which is past the limit
  return number_after(m, "rope_pool_fused supports num_qo_heads + num_kv_heads <= 65536, got ", 65537) ||
         number_after(m, "rope_pool_fused supports fewer than 2^31 tokens, got ", int64_t{1} << 31) ||
         number_after(m, "rope_pool_fused supports paged pools of fewer than 2^32 slots, got ", int64_t{1} << 32);
}

RopePoolArgs valid_rope_args(Rng& r) {
  RopePoolArgs a;
  const DType dt = r.of<DType>({DType::Float16, DType::BFloat16, DType::Float32});
  const Device dev = r.chance(90) ? Device{DeviceType::CUDA, 0} : Device{DeviceType::MPS, 0};
  const int64_t T = r.of<int64_t>({0, 1, 3, 17, 65}), hq = r.of<int64_t>({1, 2, 8, 32, 64}),
                hkv = r.of<int64_t>({1, 2, 8}), D = r.of<int64_t>({2, 6, 8, 18, 64, 128, 256, 512});
  a.q = make({T, hq, D}, dt, dev);
  a.k = make({T, hkv, D}, dt, dev);
  a.v = make({T, hkv, D}, dt, dev);
  a.positions = make({T}, r.of<DType>({DType::Int32, DType::Int64}), dev);
  a.slots = make({T}, r.of<DType>({DType::Int32, DType::Int64}), dev);
  const bool fp8 = dev.type == DeviceType::CUDA && r.chance(25);
  const DType pool_dt = fp8 ? r.of<DType>({DType::Float8E4M3FN, DType::Float8E5M2}) : dt;
  const int64_t page = r.of<int64_t>({16, 16, 0});  // pages of no slots are valid too
  switch (r.below(3)) {
    case 0:
      a.k_pool = make({20, hkv, D}, pool_dt, dev);
      a.v_pool = make({20, hkv, D}, pool_dt, dev);
      break;
    case 1:
      a.k_pool = make({3, page, hkv, D}, pool_dt, dev);
      a.v_pool = make({3, page, hkv, D}, pool_dt, dev);
      break;
    default:
      a.kv_layout = KvLayout::HND;
      a.k_pool = make({3, hkv, page, D}, pool_dt, dev);
      a.v_pool = make({3, hkv, page, D}, pool_dt, dev);
  }
  a.head_dim = D;
  a.num_qo_heads = hq;
  a.num_kv_heads = hkv;
  if (r.chance(30)) a.set_rotary_dim(2 * (1 + static_cast<int64_t>(r.below(static_cast<uint64_t>(D / 2)))));
  a.is_neox = r.chance(70);
  a.inplace = r.chance(20);
  if (r.chance(40)) {
    a.has_cache = true;
    a.cos_sin_cache = make({100, a.rot()}, r.of<DType>({DType::Float32, DType::BFloat16}), dev);
  }
  if (fp8) {
    a.has_k_scale = a.has_v_scale = true;
    a.k_scale = r.chance(50) ? make({}, DType::Float32, dev) : make({hkv}, DType::Float32, dev);
    a.v_scale = r.chance(50) ? make({1}, DType::Float32, dev) : make({hkv}, DType::Float32, dev);
  }
  a.has_q_norm = r.chance(40);
  a.has_k_norm = r.chance(40);
  if (a.has_q_norm) a.q_norm_weight = make({D}, r.chance(50) ? DType::Float32 : dt, dev);
  if (a.has_k_norm) a.k_norm_weight = make({D}, r.chance(50) ? DType::Float32 : dt, dev);
  if (r.chance(30)) a.norm_offset = 1.0;
  if (dev.type == DeviceType::CUDA && !a.inplace && r.chance(20)) {
    a.has_q_scale = true;
    a.q_scale =
        make(r.chance(50) ? std::initializer_list<int64_t>{} : std::initializer_list<int64_t>{1}, DType::Float32, dev);
  }
  return a;
}

// Size `d` (from the end when negative) of a tensor that has it.
void set_size(TensorArg& t, int d, int64_t n) {
  const int i = d < 0 ? d + t.ndim : d;
  if (i >= 0 && i < t.ndim && i < kMaxDims) t.shape[i] = n;
}

// Every tensor argument, for changes that keep them consistent.
std::vector<TensorArg*> rope_tensors(RopePoolArgs& a) {
  return {&a.q,
          &a.k,
          &a.v,
          &a.positions,
          &a.slots,
          &a.k_pool,
          &a.v_pool,
          &a.cos_sin_cache,
          &a.k_scale,
          &a.v_scale,
          &a.q_norm_weight,
          &a.k_norm_weight,
          &a.q_scale};
}

// Changes to several arguments at once that keep the earlier checks passing,
// so that the later ones (device, dtype, head_dim, the limits, fp8) are
// reached with hostile values.
void mutate_rope_together(Rng& r, RopePoolArgs& a) {
  std::vector<TensorArg*> all = rope_tensors(a);
  switch (r.below(8)) {
    case 6: {  // M-RoPE: sections (sometimes summing right), positions [3, T] or not, any strides
      a.has_mrope_section = r.chance(85);
      a.mrope_interleaved = r.chance(50);
      const int64_t half = a.rot() / 2;
      const int64_t h = r.chance(70) ? half / 4 : static_cast<int64_t>(r.below(8));
      a.mrope_section = {half - 2 * h, h, h};
      if (r.chance(20)) a.mrope_section.push_back(1);
      if (r.chance(15)) a.mrope_section[0] = -1;
      const int64_t T = a.q.ndim > 0 ? a.q.shape[0] : 0;
      a.positions = make({r.chance(85) ? 3 : 2, r.chance(90) ? T : T + 1}, a.positions.dtype, a.q.device,
                         {static_cast<int64_t>(r.below(3)) * (T + 1) + 1, static_cast<int64_t>(r.below(3))});
      break;
    }
    case 7: {  // no cache write: v, slots and the pools absent; or strided 1-D indices
      if (r.chance(50)) {
        a.has_pool = false;
        a.v = a.slots = a.k_pool = a.v_pool = TensorArg{};
      } else {
        for (TensorArg* t : {&a.positions, &a.slots})
          if (t->ndim == 1) t->strides[0] = 1 + static_cast<int64_t>(r.below(4));
      }
      break;
    }
    case 0: {  // one device for all
      const Device dev = r.device();
      for (TensorArg* t : all) t->device = dev;
      break;
    }
    case 1: {  // one dtype for q, k, v (and the pools)
      const DType dt = r.dtype();
      for (TensorArg* t : {&a.q, &a.k, &a.v, &a.k_pool, &a.v_pool}) {
        if ((t == &a.k_pool || t == &a.v_pool) && r.chance(50)) continue;
        t->dtype = dt;
        t->itemsize = test::itemsize_of(dt);
      }
      break;
    }
    case 2: {  // head_dim everywhere
      const int64_t D = r.chance(50) ? r.size() : r.of<int64_t>({0, 1, 3, 510, 514, 1024});
      a.head_dim = D;
      for (TensorArg* t : {&a.q, &a.k, &a.v, &a.k_pool, &a.v_pool}) set_size(*t, -1, D);
      for (TensorArg* t : {&a.q_norm_weight, &a.k_norm_weight}) set_size(*t, 0, D);
      break;
    }
    case 3: {  // many heads, tokens or pages; empty or expanded tensors keep them legal
      const int64_t n = r.size();
      const uint64_t which = r.below(4);
      const auto tokens = [&](int64_t t) {
        for (TensorArg* x : {&a.q, &a.k, &a.v, &a.positions, &a.slots}) set_size(*x, 0, t);
      };
      if (which == 0) {
        a.num_qo_heads = n;
        set_size(a.q, 1, n);
      }
      if (which == 1) {  // the pools' heads: 3-D and NHD pools at -2, HND at 1
        a.num_kv_heads = n;
        for (TensorArg* x : {&a.k, &a.v}) set_size(*x, 1, n);
        for (TensorArg* x : {&a.k_pool, &a.v_pool})
          set_size(*x, x->ndim == 4 && a.kv_layout == KvLayout::HND ? 1 : -2, n);
      }
      if (which == 2) tokens(n);
      if (which == 3) {  // a paged HND pool of no heads: pages * page_size past int64
        a.kv_layout = KvLayout::HND;
        a.num_kv_heads = 0;
        for (TensorArg* x : {&a.k, &a.v}) set_size(*x, 1, 0);
        const int64_t D = std::max<int64_t>(a.head_dim, 0);
        a.k_pool = make({n, 0, r.size(), D}, a.k_pool.dtype);
        a.v_pool = make({n, 0, r.size(), D}, a.v_pool.dtype);
      }
      if (r.chance(50)) tokens(0);
      break;
    }
    case 4: {  // fp8 pools, with or without their scales
      for (TensorArg* t : {&a.k_pool, &a.v_pool}) {
        t->dtype = r.of<DType>({DType::Float8E4M3FN, DType::Float8E5M2});
        t->itemsize = 1;
      }
      a.v_pool.dtype = a.k_pool.dtype;
      a.has_k_scale = r.chance(70);
      a.has_v_scale = r.chance(70);
      a.k_scale = make({}, DType::Float32, a.q.device);
      a.v_scale = make({}, DType::Float32, a.q.device);
      break;
    }
    default: {  // the norm weights alias a pool, q or k
      a.has_q_norm = true;
      a.q_norm_weight = make({a.head_dim}, DType::Float32, a.q.device);
      a.q_norm_weight.data = r.of<TensorArg*>({&a.k_pool, &a.v_pool, &a.q, &a.k})->data;
    }
  }
  for (TensorArg* t : all) legalize(*t);
}

void mutate_rope_scalars(Rng& r, RopePoolArgs& a) {
  switch (r.below(9)) {
    case 0:
      a.head_dim = r.chance(50) ? r.size() : -r.size();
      break;
    case 1:
      a.num_qo_heads = r.chance(50) ? r.size() : -r.size();
      break;
    case 2:
      a.num_kv_heads = r.chance(50) ? r.size() : -r.size();
      break;
    case 3:
      a.set_rotary_dim(r.chance(50) ? r.size() : -r.size());
      break;
    case 4:
      a.rope_base = r.of<double>({NAN, INFINITY, -1.0, 0.0, 1e-300, 1e300, 10000.0});
      break;
    case 5:
      a.norm_eps = r.of<double>({NAN, INFINITY, 0.0, -1.0, 1e-50, 1e39, 1e-6});
      break;
    case 6:
      a.norm_offset = r.of<double>({NAN, -INFINITY, 1e39, -1e39, 1.0});
      break;
    case 7:
      a.inplace = !a.inplace;
      break;
    default:
      a.kv_layout = a.kv_layout == KvLayout::NHD ? KvLayout::HND : KvLayout::NHD;
  }
}

// The host plans rope_pool_fused builds for checked arguments (the CUDA
// launch's and the Metal dispatch's); every count must come out positive.
void plan_rope(const RopePoolArgs& a) {
  const RopePoolParams p = make_rope_pool_params(a, a.q, a.k);
  CHECK(p.width >= 1 && p.qk_items_per_head >= 1 && p.v_items_per_head >= (a.has_pool ? 1 : 0));
  const int64_t items = rope_items_per_token(p);
  CHECK(items >= 1);
  const RopeCudaLaunch launch = plan_rope_cuda_launch(items, p.num_tokens);
  CHECK(launch.threads >= 32 && launch.threads <= RopeCudaPolicy::max_threads && launch.splits >= 1);
  const int lanes = rope_norm_in_rotation_kernel(p) ? p.qk_items_per_head : 1;
  RopeCudaIndex ix = plan_rope_cuda_index(p, launch.splits, lanes);
  CHECK(ix.items_per_block >= 1);
  const int64_t blocks = plan_rope_cuda_tail(ix, items, p.num_tokens, launch.threads, lanes, 132 * 10);
  CHECK(blocks >= p.num_tokens && blocks <= kRopeMaxTokens);
  CHECK(plan_rope_pool_metal(a, a.q, a.k).threadgroups == p.num_tokens);
}

TEST_CASE("rope_pool_fused: random arguments pass or raise a documented message") {
  Rng r(20261204);
  int passed = 0, rejected = 0;
  for (int round = 0; round < kRounds; ++round) {
    RopePoolArgs a = valid_rope_args(r);
    const int changes = round % 4 == 0 ? 0 : 1 + static_cast<int>(r.below(3));
    for (int c = 0; c < changes; ++c) {
      const std::vector<TensorArg*> ts = rope_tensors(a);
      const uint64_t pick = r.below(21);
      if (pick >= 17) {
        mutate_rope_together(r, a);
        continue;
      }
      if (pick >= 13) {
        mutate_rope_scalars(r, a);
        continue;
      }
      mutate(r, *ts[pick], std::vector<const TensorArg*>(ts.begin(), ts.end()));
      if (pick == 7) a.has_cache = true;
      if (pick == 8) a.has_k_scale = true;
      if (pick == 9) a.has_v_scale = true;
      if (pick == 10) a.has_q_norm = true;
      if (pick == 11) a.has_k_norm = true;
      if (pick == 12) a.has_q_scale = true;
    }
    try {
      check_rope_pool(a);
    } catch (const ValueError& e) {
      ++rejected;
      if (changes == 0 || !rope_message(e.what()))
        test::fail(__FILE__, __LINE__, std::string("round ") + std::to_string(round) + ": '" + e.what() + "'");
      continue;
    }
    ++passed;
    // the binding plans eager calls, whose tensors all have addresses
    bool addressed = true;
    for (TensorArg* t : rope_tensors(a)) addressed = addressed && t->has_address;
    if (a.q.size(0) > 0 && addressed) plan_rope(a);
  }
  // both outcomes are exercised in earnest
  CHECK(passed > kRounds / 4 && rejected > kRounds / 2);
}

// pack_qkv_destination_major's checks 1-7 (docs/contract.md).
bool pack_message(const std::string& m) {
  for (const char* e :
       {"q, k, and v must have the same 3D shape", "q, k, and v must be CUDA tensors",
        "q, k, and v must have the same device and dtype", "q, k, and v must be contiguous in head_size",
        "world_size must be positive and divide global_heads",
        "out must be a contiguous tensor with the expected shape, device, and dtype", "out must not overlap q, k, or v",
        "q, k, and v are too large: the output would exceed 2^63 - 1 bytes"})
    if (m == e) return true;
  return false;
}

TEST_CASE("pack_qkv_destination_major: random arguments pass or raise a documented message") {
  Rng r(1204);
  int passed = 0, rejected = 0;
  for (int round = 0; round < kRounds; ++round) {
    const DType dt = r.dtype();
    const int64_t rows = r.of<int64_t>({0, 1, 3, 17}), heads = r.of<int64_t>({1, 2, 4, 8}),
                  D = r.of<int64_t>({1, 8, 64, 100});
    int64_t world = std::min(heads, r.of<int64_t>({1, 2, 4}));
    TensorArg q = make({rows, heads, D}, dt), k = make({rows, heads, D}, dt), v = make({rows, heads, D}, dt);
    TensorArg out = make({world, rows, heads / world, 3 * D}, dt);
    const int changes = round % 4 == 0 ? 0 : 1 + static_cast<int>(r.below(3));
    for (int c = 0; c < changes; ++c) {
      TensorArg* ts[] = {&q, &k, &v, &out};
      const uint64_t pick = r.below(5);
      if (pick == 4) {
        world = r.chance(50) ? r.size() : -r.size();
        continue;
      }
      mutate(r, *ts[pick], {&q, &k, &v, &out});
      if (pick == 0 && r.chance(50)) k = v = q;  // shapes agree, so later checks are reached
    }
    try {
      const PackQkvShape s = check_pack_qkv_inputs(q, k, v, world);
      CHECK(s.local_heads * s.world_size == s.global_heads);
      const bool given = r.chance(70);
      if (given)
        check_pack_qkv_out(s, q, k, v, out);
      else
        check_pack_qkv_output_size(s);
      ++passed;
      for (int d = 0; d < 4; ++d) CHECK(s.out_shape[d] >= 0);
      if (!given) continue;
      if (out.numel() > 0 && out.has_address && q.has_address && k.has_address && v.has_address) {
        PackFlatPlan flat;
        plan_pack_flat(s, q, k, v, out, flat);
        const StridedCopyPlan plan = plan_pack_qkv(s, q, k, v, out);
        CHECK(plan.njobs == 3 && plan.vec_bytes >= 1);
      }
    } catch (const ValueError& e) {
      ++rejected;
      if (changes == 0 || !pack_message(e.what()))
        test::fail(__FILE__, __LINE__, std::string("round ") + std::to_string(round) + ": '" + e.what() + "'");
    }
  }
  CHECK(passed > kRounds / 10 && rejected > kRounds / 2);
}

// The Ulysses layer's local geometry checks (docs/contract.md, 1-6) and its
// grouped pack's own (internal: the layer passes CUDA tensors of unit-stride
// head_dim, and a chunk count it checked).
bool ulysses_message(const std::string& m) {
  for (const char* e :
       {"ulysses: q must be [rows, heads, head_dim] and k, v [rows, kv_heads, head_dim]",
        "ulysses: world_size must divide the number of q heads",
        "ulysses: kv_heads must divide the q heads, and divide or be a multiple of world_size",
        "ulysses: q, k and v must be on one device", "ulysses: q, k and v must have one dtype",
        "ulysses: q, k and v are too large: the exchange buffers would exceed 2^63 - 1 bytes",
        "ulysses: q, k and v must be on one CUDA device", "ulysses: q, k and v must be contiguous in head_dim",
        "ulysses: chunks must be positive and divide each rank's q heads (and its kv heads when they "
        "are split)"})
    if (m == e) return true;
  return false;
}

TEST_CASE("Ulysses grouped pack: random arguments pass or raise a documented message") {
  Rng r(1205);
  int passed = 0;
  for (int round = 0; round < kRounds; ++round) {
    const DType dt = r.dtype();
    const int64_t world = r.of<int64_t>({1, 2, 4}), kv = r.of<int64_t>({1, 2, 4, 8}), rows = r.of<int64_t>({0, 1, 5});
    const int64_t heads = std::max(world, kv) * r.of<int64_t>({1, 2}), D = r.of<int64_t>({1, 8, 64});
    TensorArg q = make({rows, heads, D}, dt), k = make({rows, kv, D}, dt), v = make({rows, kv, D}, dt);
    int64_t w = world, chunks = 1;
    const int changes = round % 4 == 0 ? 0 : 1 + static_cast<int>(r.below(3));
    for (int c = 0; c < changes; ++c) {
      const uint64_t pick = r.below(5);
      if (pick == 3)
        w = r.chance(50) ? r.size() : -r.size();
      else if (pick == 4)
        chunks = r.chance(50) ? r.of<int64_t>({2, 3, 4}) : -r.size();
      else
        mutate(r, *(pick == 0 ? &q : pick == 1 ? &k : &v), {&q, &k, &v});
    }
    try {
      const PackGqaShape s = check_pack_qkv_gqa(q, k, v, w, chunks);
      ++passed;
      for (int d = 0; d < 4; ++d) CHECK(s.out_shape[d] >= 0);
      const TensorArg out = make({s.out_shape[0], s.out_shape[1], s.out_shape[2], s.out_shape[3]}, q.dtype);
      if (out.numel() > 0 && q.has_address && k.has_address && v.has_address)
        CHECK(plan_pack_qkv_gqa(s, q, k, v, out).njobs == 3);
    } catch (const ValueError& e) {
      if (changes == 0 || !ulysses_message(e.what()))
        test::fail(__FILE__, __LINE__, std::string("round ") + std::to_string(round) + ": '" + e.what() + "'");
    }
  }
  CHECK(passed > kRounds / 4);
}

TEST_CASE("usp_merge_heads: random arguments pass or raise a documented message") {
  Rng r(4);
  int passed = 0;
  for (int round = 0; round < kRounds; ++round) {
    TensorArg x = make({2, 3, 1, 4, 8}, r.of<DType>({DType::Float16, DType::BFloat16, DType::Float32}));
    const int changes = round % 4 == 0 ? 0 : 1 + static_cast<int>(r.below(3));
    for (int c = 0; c < changes; ++c) mutate(r, x, {&x});
    int64_t shape[5];
    try {
      check_usp_merge_heads(x, shape);
      ++passed;
      for (int d = 0; d < 5; ++d) CHECK(shape[d] >= 0);
    } catch (const ValueError& e) {
      const std::string m = e.what();
      if (changes == 0 || !(m == "usp_merge_heads expects a CUDA tensor" ||
                            m == "x is too large: the output would exceed 2^63 - 1 bytes" ||
                            starts(m, "usp_merge_heads expects x to be 5-D [W, S, B, h_local, D], got torch.Size([") ||
                            starts(m, "Unsupported usp_merge_heads dtype: ")))
        test::fail(__FILE__, __LINE__, std::string("round ") + std::to_string(round) + ": '" + m + "'");
    }
  }
  CHECK(passed > kRounds / 4);
}

}  // namespace

// mla_rope_pool_fused's checks 1-36 (docs/contract.md).
bool mla_message(const std::string& m) {
  for (const char* e :
       {"mla_rope_pool_fused expects q to be 3-D and kv_c, k_pe 2-D",
        "mla_rope_pool_fused expects positions/slots to be 1-D",
        "mla_rope_pool_fused expects caches of 2 or 3 dimensions", "q, kv_c and k_pe dtypes must match",
        "cache dtypes must be q's dtype, float8_e4m3fn or float8_e5m2 (both caches alike)",
        "mla_rope_pool_fused expects all tensors on one device", "mla_rope_pool_fused expects CUDA or MPS tensors",
        "mla_rope_pool_fused expects int32 or int64 positions/slots",
        "mla_rope_pool_fused expects q, kv_c, k_pe and the caches to be contiguous in their last "
        "dimension",
        "cos_sin_cache must be contiguous in its last dimension", "rope_base must be a positive number",
        "kv_norm_weight must be contiguous", "fp8 caches need cache_scale",
        "q_scale needs inplace=False: q_rot is float8_e4m3fn", "fp8 caches and fp8 q are supported on CUDA only",
        "kv_cache and kpe_cache must not overlap each other or themselves",
        "the caches must not overlap q, kv_c, k_pe, positions, slots, cos_sin_cache, kv_norm_weight or "
        "the scales",
        "with inplace=True, q and k_pe must not overlap each other, themselves, kv_c, positions, slots, "
        "cos_sin_cache, kv_norm_weight or the scales"})
    if (m == e) return true;
  for (const char* p :
       {"kv_c, k_pe, positions and slots must have q.shape[0] = ", "q.shape[2] must be at least k_pe.shape[1] = ",
        "kv_cache must have shape [slots, ", "kpe_cache must have shape [slots, ",
        "mla_rope_pool_fused supports float16, bfloat16 and float32, got ",
        "mla_rope_pool_fused expects an even rope dimension (k_pe.shape[1]) in [2, 512], got ",
        "mla_rope_pool_fused expects kv_lora_rank (kv_c.shape[1]) in [1, 2048], got ",
        "cos_sin_cache must have shape [max_position, rotary_dim] = [*, ",
        "cos_sin_cache must be float32 or bfloat16, got ",
        "mla_rope_pool_fused supports heads * q.shape[2] <= 2^20, got ",
        "mla_rope_pool_fused supports fewer than 2^31 tokens, got ",
        "mla_rope_pool_fused supports paged caches of fewer than 2^32 slots, got ",
        "kv_norm_weight must have shape [kv_lora_rank] = [", "kv_norm_weight must be float32 or kv_c's dtype (",
        "norm_eps must be a positive finite number, got ", "cache_scale applies to fp8 caches only, got ",
        "cache_scale and q_scale must be float32, got ", "cache_scale and q_scale must have shape [] or [1], got "})
    if (starts(m, p)) return true;
  return false;
}

TEST_CASE("mla_rope_pool_fused: random arguments pass or raise a documented message") {
  Rng r(20261206);
  int passed = 0, rejected = 0;
  for (int round = 0; round < kRounds; ++round) {
    MlaRopeArgs a;
    const DType dt = r.of<DType>({DType::Float16, DType::BFloat16, DType::Float32});
    const Device dev = r.chance(90) ? Device{DeviceType::CUDA, 0} : Device{DeviceType::MPS, 0};
    const int64_t T = r.of<int64_t>({0, 1, 17}), H = r.of<int64_t>({1, 16, 128}), R = r.of<int64_t>({2, 32, 64}),
                  L = r.of<int64_t>({1, 100, 512}), nope = r.of<int64_t>({0, 128});
    const bool fp8 = dev.type == DeviceType::CUDA && r.chance(25);
    a.q = make({T, H, nope + R}, dt, dev);
    a.kv_c = make({T, L}, dt, dev, {L + R, 1});
    a.k_pe = make({T, R}, dt, dev, {L + R, 1});
    a.positions = make({T}, r.of<DType>({DType::Int32, DType::Int64}), dev);
    a.slots = make({T}, r.of<DType>({DType::Int32, DType::Int64}), dev);
    a.has_kpe_cache = r.chance(30);
    const DType cd = fp8 ? DType::Float8E4M3FN : dt;
    a.kv_cache = r.chance(50) ? make({3, 16, a.has_kpe_cache ? L : L + R}, cd, dev)
                              : make({40, a.has_kpe_cache ? L : L + R}, cd, dev);
    if (a.has_kpe_cache) a.kpe_cache = a.kv_cache.ndim == 3 ? make({3, 16, R}, cd, dev) : make({40, R}, cd, dev);
    a.is_neox = r.chance(30);
    a.inplace = r.chance(20);
    a.has_cache = r.chance(40);
    if (a.has_cache) a.cos_sin_cache = make({100, R}, DType::Float32, dev);
    a.has_norm = r.chance(60);
    if (a.has_norm) a.kv_norm_weight = make({L}, r.chance(50) ? DType::Float32 : dt, dev);
    a.has_cache_scale = fp8;
    if (fp8) a.cache_scale = make({}, DType::Float32, dev);
    a.has_q_scale = dev.type == DeviceType::CUDA && !a.inplace && r.chance(15);
    if (a.has_q_scale) a.q_scale = make({1}, DType::Float32, dev);
    std::vector<TensorArg*> ts = {&a.q,        &a.kv_c,      &a.k_pe,          &a.positions,      &a.slots,
                                  &a.kv_cache, &a.kpe_cache, &a.cos_sin_cache, &a.kv_norm_weight, &a.cache_scale,
                                  &a.q_scale};
    const int changes = round % 4 == 0 ? 0 : 1 + static_cast<int>(r.below(3));
    for (int c = 0; c < changes; ++c) {
      const uint64_t pick = r.below(14);
      if (pick == 11) {
        a.rope_base = r.of<double>({NAN, -1.0, 0.0, 1e4});
      } else if (pick == 12) {
        a.norm_eps = r.of<double>({NAN, INFINITY, 0.0, 1e-6});
      } else if (pick == 13) {
        a.inplace = !a.inplace;
      } else {
        mutate(r, *ts[pick], std::vector<const TensorArg*>(ts.begin(), ts.end()));
        if (pick == 6) a.has_kpe_cache = true;
        if (pick == 7) a.has_cache = true;
        if (pick == 8) a.has_norm = true;
        if (pick == 9) a.has_cache_scale = true;
        if (pick == 10) a.has_q_scale = true;
      }
    }
    try {
      check_mla_rope_pool(a);
    } catch (const ValueError& e) {
      ++rejected;
      if (changes == 0 || !mla_message(e.what()))
        test::fail(__FILE__, __LINE__, std::string("round ") + std::to_string(round) + ": '" + e.what() + "'");
      continue;
    }
    ++passed;
    const MlaRopeParams p = make_mla_rope_params(a, a.q, a.k_pe);  // the binding's plan of a checked call
    CHECK(p.width >= 1 && p.norm_padded >= p.kv_rank && p.cache_slots >= 0);
  }
  CHECK(passed > kRounds / 4 && rejected > kRounds / 4);
}

TEST_MAIN()
