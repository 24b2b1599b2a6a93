#include "core/rope_pool.h"

#include <utility>
#include <vector>

#include <cmath>
#include <cstdint>
#include <string>

#include "core/errors.h"
#include "core/overlap.h"

namespace attnprep::core {
namespace {

// The pool's head and head_dim sizes, by layout (checked: 3-D or 4-D).
int64_t pool_heads(const TensorArg& p, KvLayout layout) {
  return p.ndim == 3 ? p.size(1) : layout == KvLayout::NHD ? p.size(2) : p.size(1);
}

// Slots per page of a paged pool (checked: 4-D), by layout.
int64_t pool_page_size(const TensorArg& p, KvLayout layout) { return layout == KvLayout::NHD ? p.size(1) : p.size(2); }

}  // namespace

KvLayout parse_kv_layout(const std::string& name) {
  if (name == "NHD") return KvLayout::NHD;
  if (name == "HND") return KvLayout::HND;
  throw ValueError("kv_layout must be \"NHD\" or \"HND\", got " + name);
}

PoolGeometry pool_geometry(const TensorArg& pool, KvLayout layout) {
  if (pool.ndim == 3) return {pool.size(0), 1, pool.stride(0), 0, pool.stride(1)};
  const bool nhd = layout == KvLayout::NHD;
  const int64_t page_size = pool_page_size(pool, layout);
  return {pool.size(0) * page_size, page_size, pool.stride(0), nhd ? pool.stride(1) : pool.stride(2),
          nhd ? pool.stride(2) : pool.stride(1)};
}

int32_t pool_fp8_kind(DType d) { return d == DType::Float8E4M3FN ? 1 : d == DType::Float8E5M2 ? 2 : 0; }

void check_rope_table(bool has_cache, const TensorArg& c, int64_t rotary_dim, double rope_base) {
  if (has_cache) {
    if (c.ndim != 2 || c.size(1) != rotary_dim)
      throw ValueError("cos_sin_cache must have shape [max_position, rotary_dim] = [*, " + std::to_string(rotary_dim) +
                       "], got " + shape_str(c));
    if (c.dtype != DType::Float32 && c.dtype != DType::BFloat16)
      throw ValueError(std::string("cos_sin_cache must be float32 or bfloat16, got ") + dtype_name(c.dtype));
    require(c.stride(1) == 1, "cos_sin_cache must be contiguous in its last dimension");
  } else {
    require(std::isfinite(rope_base) && rope_base > 0, "rope_base must be a positive number");
  }
}

void check_cache_write_given(bool v, bool slots, bool k_pool, bool v_pool) {
  require(v == slots && v == k_pool && v == v_pool,
          "v, slots, k_pool and v_pool must be given together or all be None");
}

void check_rope_pool(const RopePoolArgs& a) {
  const TensorArg &q = a.q, &k = a.k, &v = a.v;
  // Without pools (has_pool false) v, slots and the pools are absent: every part of a check about them passes.
  const bool pool = a.has_pool;
  // Checks 1-11 of docs/contract.md: the original op's, in its order.
  const auto qkv_shapes = [&] { return shape_note({{"q", &q}, {"k", &k}, {"v", &v}}); };
  const auto pool_shapes = [&] { return shape_note({{"k_pool", &a.k_pool}, {"v_pool", &a.v_pool}}); };
  require(q.ndim == 3 && k.ndim == 3 && (!pool || v.ndim == 3), "rope_pool_fused expects q/k/v to be 3-D", qkv_shapes);
  // M-RoPE positions ([3, T]) are checked by their own check, after the others.
  const bool positions_1d = a.has_positions && !a.has_mrope_section;
  require((!positions_1d || a.positions.ndim == 1) && (!pool || a.slots.ndim == 1),
          "rope_pool_fused expects positions/slots to be 1-D",
          [&] { return shape_note({{"positions", &a.positions}, {"slots", &a.slots}}); });
  // 4-D pools are paged (docs/contract.md); the documented text is the original op's
  require(!pool || ((a.k_pool.ndim == 3 || a.k_pool.ndim == 4) && (a.v_pool.ndim == 3 || a.v_pool.ndim == 4)),
          "rope_pool_fused expects pool tensors to be 3-D", pool_shapes);
  const int64_t T = q.size(0);
  // "expected [T, heads, head_dim], got torch.Size([...])"
  const auto expected = [&](int64_t heads, const TensorArg& t) {
    return "expected [" + std::to_string(T) + ", " + std::to_string(heads) + ", " + std::to_string(a.head_dim) +
           "], got " + shape_str(t);
  };
  if (!q.has_shape({T, a.num_qo_heads, a.head_dim}))
    throw ValueError("q shape must be [num_tokens, num_qo_heads, head_dim], got " + shape_str(q),
                     expected(a.num_qo_heads, q));
  if (!k.has_shape({T, a.num_kv_heads, a.head_dim}))
    throw ValueError("k shape must be [num_tokens, num_kv_heads, head_dim], got " + shape_str(k),
                     expected(a.num_kv_heads, k));
  if (pool && !v.same_shape(k))
    throw ValueError("v shape must match k shape, got " + shape_str(v) + " vs " + shape_str(k), qkv_shapes());
  require((!positions_1d || a.positions.size(0) == T) && (!pool || a.slots.size(0) == T),
          "positions/slots must have one entry per token", [&] {
            return "num_tokens: " + std::to_string(T) + ", " +
                   shape_note({{"positions", &a.positions}, {"slots", &a.slots}});
          });
  if (pool && (pool_heads(a.k_pool, a.kv_layout) != a.num_kv_heads || a.k_pool.size(-1) != a.head_dim)) {
    const std::string hd = std::to_string(a.num_kv_heads) + ", " + std::to_string(a.head_dim);
    const std::string paged = a.kv_layout == KvLayout::NHD ? "[pages, page_size, " + hd + "]"
                                                           : "[pages, " + std::to_string(a.num_kv_heads) +
                                                                 ", page_size, " + std::to_string(a.head_dim) + "]";
    throw ValueError("k_pool has incompatible shape " + shape_str(a.k_pool),
                     "expected [slots, " + hd + "] or " + paged + ", got " + shape_str(a.k_pool));
  }
  if (pool && !a.v_pool.same_shape(a.k_pool))
    throw ValueError("v_pool shape must match k_pool shape, got " + shape_str(a.v_pool) + " vs " + shape_str(a.k_pool),
                     pool_shapes());
  require(q.dtype == k.dtype && (!pool || q.dtype == v.dtype), "q/k/v dtypes must match",
          [&] { return dtype_device_note({{"q", &q}, {"k", &k}, {"v", &v}}); });
  // fp8 pools (with their scales) are this library's addition to check 11
  require(!pool || ((a.k_pool.dtype == q.dtype || is_fp8(a.k_pool.dtype)) && a.v_pool.dtype == a.k_pool.dtype),
          "pool dtypes must match q/k/v dtype",
          [&] { return dtype_device_note({{"q", &q}, {"k_pool", &a.k_pool}, {"v_pool", &a.v_pool}}); });

  // Checks 12 on: this library's own.
  // every tensor given, with its name, for the device check and its note
  std::vector<std::pair<const char*, const TensorArg*>> given = {{"q", &q}, {"k", &k}};
  if (pool) given.push_back({"v", &v});
  if (a.has_positions) given.push_back({"positions", &a.positions});
  if (pool)
    for (const auto& named :
         {std::pair<const char*, const TensorArg*>{"slots", &a.slots}, {"k_pool", &a.k_pool}, {"v_pool", &a.v_pool}})
      given.push_back(named);
  if (a.has_cache) given.push_back({"cos_sin_cache", &a.cos_sin_cache});
  if (a.has_k_scale) given.push_back({"k_scale", &a.k_scale});
  if (a.has_v_scale) given.push_back({"v_scale", &a.v_scale});
  if (a.has_q_scale) given.push_back({"q_scale", &a.q_scale});
  if (a.has_q_norm) given.push_back({"q_norm_weight", &a.q_norm_weight});
  if (a.has_k_norm) given.push_back({"k_norm_weight", &a.k_norm_weight});
  require_one_device(given, "rope_pool_fused expects all tensors on one device");
  require(q.device.type == DeviceType::CUDA || q.device.type == DeviceType::MPS,
          "rope_pool_fused expects CUDA or MPS tensors");
  if (!is_float_type(q.dtype))
    throw ValueError(std::string("rope_pool_fused supports float16, bfloat16 and float32, got ") + dtype_name(q.dtype));
  if (a.head_dim % 2 != 0 || a.head_dim <= 0 || a.head_dim > 2 * ATTNPREP_ROPE_MAX_HALF)
    throw ValueError("rope_pool_fused expects an even head_dim in [2, 512], got " + std::to_string(a.head_dim));
  const int64_t rot = a.rot();
  if (rot % 2 != 0 || rot <= 0 || rot > a.head_dim)
    throw ValueError("rope_pool_fused expects an even rotary_dim in [2, head_dim], got " + std::to_string(rot));
  const auto is_index = [](DType d) { return d == DType::Int32 || d == DType::Int64; };
  require((!a.has_positions || is_index(a.positions.dtype)) && (!pool || is_index(a.slots.dtype)),
          "rope_pool_fused expects int32 or int64 positions/slots");
  for (const TensorArg* t : {&q, &k, &v, &a.k_pool, &a.v_pool})
    require((!pool && t != &q && t != &k) || t->stride(-1) == 1,
            "rope_pool_fused expects q, k, v and the pools to be contiguous in head_dim");
  check_rope_table(a.has_cache, a.cos_sin_cache, rot, a.rope_base);
  // The counts below are tensor sizes (checks 4-8), so never negative; their
  // sum and product are formed without overflow.
  const uint64_t heads = static_cast<uint64_t>(a.num_qo_heads) + static_cast<uint64_t>(a.num_kv_heads);
  if (heads > kRopeMaxHeads)
    throw ValueError("rope_pool_fused supports num_qo_heads + num_kv_heads <= 65536, got " + std::to_string(heads));
  if (T > kRopeMaxTokens) throw ValueError("rope_pool_fused supports fewer than 2^31 tokens, got " + std::to_string(T));
  if (pool && a.k_pool.ndim == 4) {
    // an HND pool with no heads can have pages * page_size past int64
    const int64_t pages = a.k_pool.size(0), page_size = pool_page_size(a.k_pool, a.kv_layout);
    if (page_size > 0 && pages > kRopeMaxPagedSlots / page_size)
      throw ValueError("rope_pool_fused supports paged pools of fewer than 2^32 slots, got " +
                       product_str(static_cast<uint64_t>(pages), static_cast<uint64_t>(page_size)));
  }

  // What the kernel writes must not race with itself or with what it reads.
  const TensorArg* reads[9] = {&q, &k};
  int nreads = 2;
  if (pool) {
    reads[nreads++] = &v;
    reads[nreads++] = &a.slots;
  }
  if (a.has_positions) reads[nreads++] = &a.positions;
  if (a.has_cache) reads[nreads++] = &a.cos_sin_cache;
  if (a.has_k_scale) reads[nreads++] = &a.k_scale;
  if (a.has_v_scale) reads[nreads++] = &a.v_scale;
  if (a.has_q_scale) reads[nreads++] = &a.q_scale;
  require(
      !pool || (!has_internal_overlap(a.k_pool) && !has_internal_overlap(a.v_pool) && !may_overlap(a.k_pool, a.v_pool)),
      "k_pool and v_pool must not overlap each other or themselves");
  for (int i = 0; pool && i < nreads; ++i)
    require(!may_overlap(a.k_pool, *reads[i]) && !may_overlap(a.v_pool, *reads[i]),
            "k_pool and v_pool must not overlap q, k, v, positions, slots, cos_sin_cache or the scales");
  if (a.inplace) {
    bool ok = !has_internal_overlap(q) && !has_internal_overlap(k) && !may_overlap(q, k);
    for (int i = 2; i < nreads; ++i) ok = ok && !may_overlap(q, *reads[i]) && !may_overlap(k, *reads[i]);
    require(ok,
            "with inplace=True, q and k must not overlap each other, themselves, v, positions, slots, "
            "cos_sin_cache or the scales");
  }

  // fp8 pools and their scales.
  const bool fp8 = pool && is_fp8(a.k_pool.dtype);
  require(!fp8 || (a.has_k_scale && a.has_v_scale), "fp8 pools need k_scale and v_scale");
  if (!fp8 && (a.has_k_scale || a.has_v_scale))
    throw ValueError(std::string("k_scale and v_scale apply to fp8 pools only, got ") +
                     (pool ? dtype_name(a.k_pool.dtype) : "no") + " pools");
  for (const TensorArg* sc : {&a.k_scale, &a.v_scale}) {
    if (!fp8) continue;  // no scales to check
    if (sc->dtype != DType::Float32)
      throw ValueError(std::string("k_scale and v_scale must be float32, got ") + dtype_name(sc->dtype));
    const bool one = sc->ndim == 0 || (sc->ndim == 1 && sc->size(0) == 1);
    const bool per_head = sc->ndim == 1 && sc->size(0) == a.num_kv_heads && (a.num_kv_heads <= 1 || sc->stride(0) == 1);
    if (!one && !per_head)
      throw ValueError("k_scale and v_scale must have shape [], [1] or [num_kv_heads] (contiguous), got " +
                       shape_str(*sc));
  }
  require(!fp8 || q.device.type == DeviceType::CUDA, "fp8 pools are supported on CUDA only");

  // The QK norm.
  const TensorArg* weights[2];
  int nweights = 0;
  if (a.has_q_norm) weights[nweights++] = &a.q_norm_weight;
  if (a.has_k_norm) weights[nweights++] = &a.k_norm_weight;
  for (int i = 0; i < nweights; ++i)
    if (!weights[i]->has_shape({a.head_dim}))
      throw ValueError("q_norm_weight and k_norm_weight must have shape [head_dim] = [" + std::to_string(a.head_dim) +
                       "], got " + shape_str(*weights[i]));
  for (int i = 0; i < nweights; ++i)
    if (weights[i]->dtype != DType::Float32 && weights[i]->dtype != q.dtype)
      throw ValueError(std::string("q_norm_weight and k_norm_weight must be float32 or q's dtype (") +
                       dtype_name(q.dtype) + "), got " + dtype_name(weights[i]->dtype));
  for (int i = 0; i < nweights; ++i)
    require(weights[i]->size(0) <= 1 || weights[i]->stride(0) == 1,
            "q_norm_weight and k_norm_weight must be contiguous");
  // as the kernels use it: a float32 that is positive and finite
  const float eps32 = static_cast<float>(a.norm_eps);
  if (!(std::isfinite(eps32) && eps32 > 0))
    throw ValueError("norm_eps must be a positive finite number, got " + number_str(a.norm_eps));
  if (!std::isfinite(static_cast<float>(a.norm_offset)))
    throw ValueError("norm_weight_offset must be finite, got " + number_str(a.norm_offset));
  for (int i = 0; i < nweights; ++i) {
    bool ok = !pool || (!may_overlap(a.k_pool, *weights[i]) && !may_overlap(a.v_pool, *weights[i]));
    if (a.inplace) ok = ok && !may_overlap(q, *weights[i]) && !may_overlap(k, *weights[i]);
    require(ok, "k_pool and v_pool (and q and k with inplace=True) must not overlap q_norm_weight or k_norm_weight");
  }

  // Per-token cos/sin: without positions, token t reads row t of cos_sin_cache.
  if (!a.has_positions && !(a.has_cache && a.cos_sin_cache.size(0) == T))
    throw ValueError("positions=None needs cos_sin_cache of one row per token, [num_tokens, rotary_dim] = [" +
                         std::to_string(T) + ", " + std::to_string(rot) + "]",
                     a.has_cache ? "got " + shape_str(a.cos_sin_cache) : "got no cos_sin_cache");

  // M-RoPE.
  if (a.has_mrope_section) {
    const std::vector<int64_t>& sec = a.mrope_section;
    bool ok = sec.size() == 3;
    int64_t sum = 0;
    for (int64_t n : sec) {
      ok = ok && n >= 0 && n <= rot;
      sum += ok ? n : 0;
    }
    if (!ok || sum != rot / 2) {
      std::string got;
      for (int64_t n : sec) got += (got.empty() ? "" : ", ") + std::to_string(n);
      throw ValueError("mrope_section must be three non-negative integers summing to rotary_dim / 2 = " +
                       std::to_string(rot / 2) + ", got [" + got + "]");
    }
  }
  require(!a.mrope_interleaved || a.has_mrope_section, "mrope_interleaved=True needs mrope_section");
  if (a.has_mrope_section && !(a.has_positions && a.positions.has_shape({3, T})))
    throw ValueError("M-RoPE positions must have shape [3, num_tokens] = [3, " + std::to_string(T) + "], got " +
                     (a.has_positions ? shape_str(a.positions) : std::string("None")));

  // fp8 q.
  if (a.has_q_scale) {
    const TensorArg& s = a.q_scale;
    if (s.dtype != DType::Float32) throw ValueError(std::string("q_scale must be float32, got ") + dtype_name(s.dtype));
    if (!(s.ndim == 0 || s.has_shape({1}))) throw ValueError("q_scale must have shape [] or [1], got " + shape_str(s));
    require(!a.inplace, "q_scale needs inplace=False: q_rot is float8_e4m3fn");
    require(q.device.type == DeviceType::CUDA, "fp8 q is supported on CUDA only");
  }
}

std::vector<float> rope_inv_freq(double base, int64_t rotary_dim) {
  std::vector<float> f(static_cast<size_t>(rotary_dim / 2));
  for (int64_t i = 0; i < rotary_dim / 2; ++i)
    f[i] = static_cast<float>(1.0 / std::pow(base, static_cast<double>(2 * i) / static_cast<double>(rotary_dim)));
  return f;
}

RopePoolParams make_rope_pool_params(const RopePoolArgs& a, const TensorArg& q_rot, const TensorArg& k_rot,
                                     int vector_bytes) {
  RopePoolParams p{};
  p.num_tokens = a.q.size(0);
  // without pools: no slots, nothing read from v (a pool of no slots, no v items)
  const PoolGeometry none{0, 1, 0, 0, 0};
  const PoolGeometry kg = a.has_pool ? pool_geometry(a.k_pool, a.kv_layout) : none;
  const PoolGeometry vg = a.has_pool ? pool_geometry(a.v_pool, a.kv_layout) : none;
  p.pool_size = kg.slots;
  p.page_size = kg.page_size;
  p.q_stride_token = a.q.stride(0);
  p.q_stride_head = a.q.stride(1);
  p.k_stride_token = a.k.stride(0);
  p.k_stride_head = a.k.stride(1);
  p.v_stride_token = a.has_pool ? a.v.stride(0) : 0;
  p.v_stride_head = a.has_pool ? a.v.stride(1) : 0;
  p.qo_stride_token = q_rot.stride(0);
  p.qo_stride_head = q_rot.stride(1);
  p.ko_stride_token = k_rot.stride(0);
  p.ko_stride_head = k_rot.stride(1);
  p.kp_stride_page = kg.stride_page;
  p.kp_stride_offset = kg.stride_offset;
  p.kp_stride_head = kg.stride_head;
  p.vp_stride_page = vg.stride_page;
  p.vp_stride_offset = vg.stride_offset;
  p.vp_stride_head = vg.stride_head;
  p.pool_fp8 = a.has_pool ? pool_fp8_kind(a.k_pool.dtype) : 0;
  p.k_scale_per_head = a.has_k_scale && a.k_scale.ndim == 1 && a.k_scale.size(0) > 1 ? 1 : 0;
  p.v_scale_per_head = a.has_v_scale && a.v_scale.ndim == 1 && a.v_scale.size(0) > 1 ? 1 : 0;
  p.norm_q = a.has_q_norm ? 1 : 0;
  p.norm_k = a.has_k_norm ? 1 : 0;
  p.q_norm_f32 = a.has_q_norm && a.q_norm_weight.dtype == DType::Float32 ? 1 : 0;
  p.k_norm_f32 = a.has_k_norm && a.k_norm_weight.dtype == DType::Float32 ? 1 : 0;
  p.norm_eps = static_cast<float>(a.norm_eps);
  p.norm_offset = static_cast<float>(a.norm_offset);
  p.num_qo_heads = static_cast<ap_i32>(a.num_qo_heads);
  p.num_kv_heads = static_cast<ap_i32>(a.num_kv_heads);
  p.head_dim = static_cast<ap_i32>(a.head_dim);
  p.rotary_dim = static_cast<ap_i32>(a.rot());
  p.is_neox = a.is_neox ? 1 : 0;
  p.positions_kind = !a.has_positions ? 2 : a.positions.dtype == DType::Int64 ? 1 : 0;
  if (a.has_positions) {
    p.pos_stride_token = a.positions.stride(-1);
    p.pos_stride_axis = a.has_mrope_section ? a.positions.stride(0) : 0;
  }
  p.slots_int64 = a.slots.dtype == DType::Int64 ? 1 : 0;
  p.slots_stride = a.has_pool ? a.slots.stride(0) : 0;
  if (a.has_mrope_section) {
    p.mrope = a.mrope_interleaved ? 2 : 1;
    for (int j = 0; j < 3; ++j) p.mrope_section[j] = static_cast<ap_i32>(a.mrope_section[static_cast<size_t>(j)]);
  }
  p.q_fp8 = a.has_q_scale ? 1 : 0;
  p.use_cache = a.has_cache ? 1 : 0;
  if (a.has_cache) {
    p.cache_stride = a.cos_sin_cache.stride(0);
    p.cache_len = a.cos_sin_cache.size(0);
    p.cache_bf16 = a.cos_sin_cache.dtype == DType::BFloat16 ? 1 : 0;
    // The CUDA rotation kernel reads a token's cos/sin straight from its row,
    // 16 bytes at a time, where the base, the row stride and the sin half
    // all start on 16-byte boundaries.
    const TensorArg& c = a.cos_sin_cache;
    const bool on16 = reinterpret_cast<uintptr_t>(c.data) % 16 == 0 && c.byte_stride(0) % 16 == 0 &&
                      (a.rot() / 2 * c.itemsize) % 16 == 0;
    // M-RoPE tokens read three rows: the table path gathers them.
    p.cache_vector = on16 && !a.has_mrope_section ? 1 : 0;
  } else {
    const std::vector<float> f = rope_inv_freq(a.rope_base, a.rot());
    for (size_t i = 0; i < f.size(); ++i) p.inv_freq[i] = f[i];
  }

  // Vector width: 16 bytes' worth of elements when every address, stride and
  // size allows it (and, for GPT-J, a vector holds whole pairs); else one.
  const int64_t es = a.q.itemsize;
  const int64_t w = vector_bytes / es;
  bool vec = w > 1;
  const int64_t half = a.rot() / 2;
  if (a.is_neox ? half % w != 0 : a.rot() % w != 0) vec = false;
  if (a.head_dim % w != 0) vec = false;
  // Every address a vector touches must be aligned to its size: 16 bytes in
  // q, k and v, w elements in the outputs and the pools (w bytes in fp8).
  // A stride only matters when its dimension has more than one index.
  const auto aligned = [&](const TensorArg& t, int64_t bytes) {
    if (reinterpret_cast<uintptr_t>(t.data) % bytes != 0) return false;
    for (int d = 0; d + 1 < t.ndim; ++d)
      if (t.byte_stride(d) % bytes != 0) return false;
    return true;
  };
  for (const TensorArg* t : {&a.q, &a.k}) vec = vec && aligned(*t, vector_bytes);
  for (const TensorArg* t : {&q_rot, &k_rot}) vec = vec && aligned(*t, w * t->itemsize);
  if (a.has_pool) {
    vec = vec && aligned(a.v, vector_bytes);
    for (const TensorArg* t : {&a.k_pool, &a.v_pool}) vec = vec && aligned(*t, w * t->itemsize);
  }
  p.width = static_cast<ap_i32>(vec ? w : 1);
  // Items of a q/k head: rotated groups (NeoX: `width` pairs from the two
  // halves; GPT-J: width/2 adjacent pairs, at least one) + passed-through groups.
  const int64_t rot_items = a.is_neox ? half / p.width : a.rot() / (p.width == 1 ? 2 : p.width);
  p.qk_items_per_head = static_cast<ap_i32>(rot_items + (a.head_dim - a.rot()) / p.width);
  // Items of a v head: two groups half a head apart (a NeoX q/k item's size), so that q, k and v items move the same
  // bytes and rounds come out whole (32/8 heads at head_dim 128: three rounds of 128 threads, not 3.5).
  const RopeNormSplit split = plan_rope_norm_split(a.head_dim, p.width);
  p.norm_lanes = split.lanes;
  p.norm_per_lane = split.per_lane;
  const int64_t v_groups = a.head_dim / p.width;
  p.v_items_per_head = !a.has_pool ? 0 : static_cast<ap_i32>(v_groups % 2 == 0 ? v_groups / 2 : v_groups);
  return p;
}

MetalDispatch plan_rope_pool_metal(const RopePoolArgs& a, const TensorArg& q_rot, const TensorArg& k_rot) {
  MetalDispatch d;
  // The Metal kernel moves one element at a time and ignores `width`.
  d.params = make_rope_pool_params(a, q_rot, k_rot, /*vector_bytes=*/16);
  d.threadgroups = a.q.size(0);
  d.threads_per_group = 128;
  return d;
}

}  // namespace attnprep::core
