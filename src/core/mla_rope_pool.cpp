#include "core/mla_rope_pool.h"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "core/errors.h"
#include "core/overlap.h"
#include "core/rope_pool.h"

namespace attnprep::core {
namespace {

// Whether a cache has the shape [slots, width] or [pages, page_size, width] (sizes are never negative).
bool cache_shape(const TensorArg& c, uint64_t width) {
  return (c.ndim == 2 || c.ndim == 3) && static_cast<uint64_t>(c.size(-1)) == width;
}

std::string cache_shapes(uint64_t width) {
  const std::string w = std::to_string(width);
  return "[slots, " + w + "] or [pages, page_size, " + w + "]";
}

// A scale: float32, one value.
void check_scale(const TensorArg& s) {
  if (s.dtype != DType::Float32)
    throw ValueError(std::string("cache_scale and q_scale must be float32, got ") + dtype_name(s.dtype));
  if (!(s.ndim == 0 || s.has_shape({1})))
    throw ValueError("cache_scale and q_scale must have shape [] or [1], got " + shape_str(s));
}

}  // namespace

int64_t mla_cache_slots(const TensorArg& kv_cache) {
  return kv_cache.ndim == 2 ? kv_cache.size(0) : kv_cache.size(0) * kv_cache.size(1);
}

void check_mla_rope_pool(const MlaRopeArgs& a) {
  const TensorArg &q = a.q, &kv = a.kv_c, &pe = a.k_pe;
  require(q.ndim == 3 && kv.ndim == 2 && pe.ndim == 2, "mla_rope_pool_fused expects q to be 3-D and kv_c, k_pe 2-D");
  require(a.positions.ndim == 1 && a.slots.ndim == 1, "mla_rope_pool_fused expects positions/slots to be 1-D");
  require((a.kv_cache.ndim == 2 || a.kv_cache.ndim == 3) &&
              (!a.has_kpe_cache || a.kpe_cache.ndim == 2 || a.kpe_cache.ndim == 3),
          "mla_rope_pool_fused expects caches of 2 or 3 dimensions");
  const int64_t T = q.size(0), L = kv.size(1), R = pe.size(1);
  require(
      kv.size(0) == T && pe.size(0) == T && a.positions.size(0) == T && a.slots.size(0) == T,
      ("kv_c, k_pe, positions and slots must have q.shape[0] = " + std::to_string(T) + " rows").c_str(), [&] {
        return shape_note({{"q", &q}, {"kv_c", &kv}, {"k_pe", &pe}, {"positions", &a.positions}, {"slots", &a.slots}});
      });
  if (q.size(2) < R)
    throw ValueError("q.shape[2] must be at least k_pe.shape[1] = " + std::to_string(R) + ", got " +
                     std::to_string(q.size(2)));
  // L + R in 64 unsigned bits: an empty tensor may have a size near 2^63
  const uint64_t width = static_cast<uint64_t>(L) + (a.has_kpe_cache ? 0 : static_cast<uint64_t>(R));
  if (!cache_shape(a.kv_cache, width))
    throw ValueError("kv_cache must have shape " + cache_shapes(width) + ", got " + shape_str(a.kv_cache));
  if (a.has_kpe_cache) {
    const TensorArg& c = a.kpe_cache;
    const bool same_slots = c.ndim == a.kv_cache.ndim && c.size(0) == a.kv_cache.size(0) &&
                            (c.ndim == 2 || c.size(1) == a.kv_cache.size(1));
    if (!cache_shape(c, static_cast<uint64_t>(R)) || !same_slots)
      throw ValueError("kpe_cache must have shape " + cache_shapes(static_cast<uint64_t>(R)) +
                       " with kv_cache's slots, got " + shape_str(c));
  }
  require(q.dtype == kv.dtype && q.dtype == pe.dtype, "q, kv_c and k_pe dtypes must match",
          [&] { return dtype_device_note({{"q", &q}, {"kv_c", &kv}, {"k_pe", &pe}}); });
  const DType cd = a.kv_cache.dtype;
  require((cd == q.dtype || is_fp8(cd)) && (!a.has_kpe_cache || a.kpe_cache.dtype == cd),
          "cache dtypes must be q's dtype, float8_e4m3fn or float8_e5m2 (both caches alike)",
          [&] { return dtype_device_note({{"q", &q}, {"kv_cache", &a.kv_cache}, {"kpe_cache", &a.kpe_cache}}); });

  // every tensor given, with its name, for the device check and its note
  std::vector<std::pair<const char*, const TensorArg*>> given = {{"q", &q},           {"kv_c", &kv},
                                                                 {"k_pe", &pe},       {"positions", &a.positions},
                                                                 {"slots", &a.slots}, {"kv_cache", &a.kv_cache}};
  if (a.has_kpe_cache) given.push_back({"kpe_cache", &a.kpe_cache});
  if (a.has_cache) given.push_back({"cos_sin_cache", &a.cos_sin_cache});
  if (a.has_norm) given.push_back({"kv_norm_weight", &a.kv_norm_weight});
  if (a.has_cache_scale) given.push_back({"cache_scale", &a.cache_scale});
  if (a.has_q_scale) given.push_back({"q_scale", &a.q_scale});
  require_one_device(given, "mla_rope_pool_fused expects all tensors on one device");
  require(q.device.type == DeviceType::CUDA || q.device.type == DeviceType::MPS,
          "mla_rope_pool_fused expects CUDA or MPS tensors");
  if (!is_float_type(q.dtype))
    throw ValueError(std::string("mla_rope_pool_fused supports float16, bfloat16 and float32, got ") +
                     dtype_name(q.dtype));
  if (R % 2 != 0 || R < 2 || R > kMlaMaxRope)
    throw ValueError("mla_rope_pool_fused expects an even rope dimension (k_pe.shape[1]) in [2, 512], got " +
                     std::to_string(R));
  if (L < 1 || L > kMlaMaxRank)
    throw ValueError("mla_rope_pool_fused expects kv_lora_rank (kv_c.shape[1]) in [1, 2048], got " + std::to_string(L));
  const auto is_index = [](DType d) { return d == DType::Int32 || d == DType::Int64; };
  require(is_index(a.positions.dtype) && is_index(a.slots.dtype),
          "mla_rope_pool_fused expects int32 or int64 positions/slots");
  bool unit = q.stride(-1) == 1 && kv.stride(-1) == 1 && pe.stride(-1) == 1 && a.kv_cache.stride(-1) == 1;
  if (a.has_kpe_cache) unit = unit && a.kpe_cache.stride(-1) == 1;
  require(unit, "mla_rope_pool_fused expects q, kv_c, k_pe and the caches to be contiguous in their last dimension");
  check_rope_table(a.has_cache, a.cos_sin_cache, R, a.rope_base);
  const int64_t heads = q.size(1), q_dim = q.size(2);
  if (heads > 0 && q_dim > kMlaMaxHeadElements / heads)
    throw ValueError("mla_rope_pool_fused supports heads * q.shape[2] <= 2^20, got " +
                     product_str(static_cast<uint64_t>(heads), static_cast<uint64_t>(q_dim)));
  if (T > kRopeMaxTokens)
    throw ValueError("mla_rope_pool_fused supports fewer than 2^31 tokens, got " + std::to_string(T));
  if (a.kv_cache.ndim == 3) {
    const int64_t pages = a.kv_cache.size(0), page_size = a.kv_cache.size(1);
    if (page_size > 0 && pages > kRopeMaxPagedSlots / page_size)
      throw ValueError("mla_rope_pool_fused supports paged caches of fewer than 2^32 slots, got " +
                       product_str(static_cast<uint64_t>(pages), static_cast<uint64_t>(page_size)));
  }

  // The norm of kv_c.
  if (a.has_norm) {
    const TensorArg& w = a.kv_norm_weight;
    if (!w.has_shape({L}))
      throw ValueError("kv_norm_weight must have shape [kv_lora_rank] = [" + std::to_string(L) + "], got " +
                       shape_str(w));
    if (w.dtype != DType::Float32 && w.dtype != kv.dtype)
      throw ValueError(std::string("kv_norm_weight must be float32 or kv_c's dtype (") + dtype_name(kv.dtype) +
                       "), got " + dtype_name(w.dtype));
    require(w.size(0) <= 1 || w.stride(0) == 1, "kv_norm_weight must be contiguous");
  }
  const float eps32 = static_cast<float>(a.norm_eps);
  if (!(std::isfinite(eps32) && eps32 > 0))
    throw ValueError("norm_eps must be a positive finite number, got " + number_str(a.norm_eps));

  // fp8 caches and fp8 q.
  const bool fp8 = is_fp8(cd);
  require(!fp8 || a.has_cache_scale, "fp8 caches need cache_scale");
  if (!fp8 && a.has_cache_scale)
    throw ValueError(std::string("cache_scale applies to fp8 caches only, got ") + dtype_name(cd) + " caches");
  if (a.has_cache_scale) check_scale(a.cache_scale);
  if (a.has_q_scale) check_scale(a.q_scale);
  require(!a.has_q_scale || !a.inplace, "q_scale needs inplace=False: q_rot is float8_e4m3fn");
  require(!(fp8 || a.has_q_scale) || q.device.type == DeviceType::CUDA,
          "fp8 caches and fp8 q are supported on CUDA only");

  // What the kernel writes must not race with itself or with what it reads.
  std::vector<const TensorArg*> reads = {&q, &kv, &pe, &a.positions, &a.slots};
  for (const auto& [has, t] : {std::pair<bool, const TensorArg*>{a.has_cache, &a.cos_sin_cache},
                               {a.has_norm, &a.kv_norm_weight},
                               {a.has_cache_scale, &a.cache_scale},
                               {a.has_q_scale, &a.q_scale}})
    if (has) reads.push_back(t);
  require(!has_internal_overlap(a.kv_cache) &&
              (!a.has_kpe_cache || (!has_internal_overlap(a.kpe_cache) && !may_overlap(a.kv_cache, a.kpe_cache))),
          "kv_cache and kpe_cache must not overlap each other or themselves");
  for (const TensorArg* r : reads)
    require(!may_overlap(a.kv_cache, *r) && (!a.has_kpe_cache || !may_overlap(a.kpe_cache, *r)),
            "the caches must not overlap q, kv_c, k_pe, positions, slots, cos_sin_cache, kv_norm_weight or the "
            "scales");
  if (a.inplace) {
    bool ok = !has_internal_overlap(q) && !has_internal_overlap(pe) && !may_overlap(q, pe);
    for (size_t i = 3; i < reads.size(); ++i) ok = ok && !may_overlap(q, *reads[i]) && !may_overlap(pe, *reads[i]);
    ok = ok && !may_overlap(q, kv) && !may_overlap(pe, kv);
    require(ok,
            "with inplace=True, q and k_pe must not overlap each other, themselves, kv_c, positions, slots, "
            "cos_sin_cache, kv_norm_weight or the scales");
  }
}

MlaRopeParams make_mla_rope_params(const MlaRopeArgs& a, const TensorArg& q_rot, const TensorArg& k_pe_rot,
                                   int vector_bytes) {
  MlaRopeParams p{};
  const TensorArg& c = a.kv_cache;
  const int64_t L = a.kv_c.size(1), R = a.k_pe.size(1);
  p.num_tokens = a.q.size(0);
  p.cache_slots = mla_cache_slots(c);
  p.page_size = c.ndim == 3 ? c.size(1) : 1;
  p.q_stride_token = a.q.stride(0);
  p.q_stride_head = a.q.stride(1);
  p.qo_stride_token = q_rot.stride(0);
  p.qo_stride_head = q_rot.stride(1);
  p.kv_stride = a.kv_c.stride(0);
  p.pe_stride = a.k_pe.stride(0);
  p.pe_out_stride = k_pe_rot.stride(0);
  p.kv_stride_page = c.stride(0);
  p.kv_stride_offset = c.ndim == 3 ? c.stride(1) : 0;
  const TensorArg& kc = a.has_kpe_cache ? a.kpe_cache : c;
  p.kpe_stride_page = kc.stride(0);
  p.kpe_stride_offset = kc.ndim == 3 ? kc.stride(1) : 0;
  p.pos_stride = a.positions.stride(0);
  p.slots_stride = a.slots.stride(0);
  p.heads = static_cast<ap_i32>(a.q.size(1));
  p.q_dim = static_cast<ap_i32>(a.q.size(2));
  p.rotary_dim = static_cast<ap_i32>(R);
  p.kv_rank = static_cast<ap_i32>(L);
  p.is_neox = a.is_neox ? 1 : 0;
  p.positions_int64 = a.positions.dtype == DType::Int64 ? 1 : 0;
  p.slots_int64 = a.slots.dtype == DType::Int64 ? 1 : 0;
  p.cache_fp8 = pool_fp8_kind(c.dtype);
  p.q_fp8 = a.has_q_scale ? 1 : 0;
  p.inplace = a.inplace ? 1 : 0;
  p.norm = a.has_norm ? 1 : 0;
  p.norm_f32 = a.has_norm && a.kv_norm_weight.dtype == DType::Float32 ? 1 : 0;
  int32_t padded = 1;
  while (padded < L) padded *= 2;
  p.norm_padded = padded;
  p.norm_eps = static_cast<float>(a.norm_eps);
  p.use_cache = a.has_cache ? 1 : 0;
  if (a.has_cache) {
    p.cache_stride = a.cos_sin_cache.stride(0);
    p.cache_len = a.cos_sin_cache.size(0);
    p.cache_bf16 = a.cos_sin_cache.dtype == DType::BFloat16 ? 1 : 0;
  } else {
    const std::vector<float> f = rope_inv_freq(a.rope_base, R);
    for (size_t i = 0; i < f.size(); ++i) p.inv_freq[i] = f[i];
  }
  // Vector width: 16 bytes' worth of elements where every row, its parts (nope, the rope halves or pairs, kv_c) and
  // every address allow it: 16 bytes in the inputs, the group's size in the outputs and caches.
  const int64_t w = vector_bytes / a.q.itemsize;
  const int64_t nope = a.q.size(2) - R;
  bool vec = w > 1 && nope % w == 0 && L % w == 0 && (a.is_neox ? (R / 2) % w == 0 : R % w == 0);
  const auto aligned = [&](const TensorArg& t, int64_t bytes) {
    if (reinterpret_cast<uintptr_t>(t.data) % bytes != 0) return false;
    for (int d = 0; d + 1 < t.ndim; ++d)
      if (t.byte_stride(d) % bytes != 0) return false;
    return true;
  };
  for (const TensorArg* t : {&a.q, &a.kv_c, &a.k_pe}) vec = vec && aligned(*t, vector_bytes);
  for (const TensorArg* t : {&q_rot, &k_pe_rot, &c}) vec = vec && aligned(*t, w * t->itemsize);
  if (a.has_kpe_cache) vec = vec && aligned(a.kpe_cache, w * a.kpe_cache.itemsize);
  p.width = static_cast<ap_i32>(vec ? w : 1);
  return p;
}

MlaMetalDispatch plan_mla_rope_pool_metal(const MlaRopeArgs& a, const TensorArg& q_rot, const TensorArg& k_pe_rot) {
  // The Metal kernel moves one element at a time and ignores `width`.
  return {make_mla_rope_params(a, q_rot, k_pe_rot), a.q.size(0), kMlaThreads};
}

}  // namespace attnprep::core
