#include "cpu/rope_pool_reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "cpu/float_bits.h"

namespace attnprep::cpu {
namespace {

double read_scalar(const core::TensorArg& t, int64_t offset) {
  const auto* base = static_cast<const unsigned char*>(t.data) + offset * t.itemsize;
  uint16_t h;
  switch (t.dtype) {
    case core::DType::Float32: {
      float f;
      std::memcpy(&f, base, 4);
      return f;
    }
    case core::DType::Float16:
      std::memcpy(&h, base, 2);
      return half_to_float(h);
    case core::DType::BFloat16:
      std::memcpy(&h, base, 2);
      return bf16_to_float(h);
    case core::DType::Int32: {
      int32_t i;
      std::memcpy(&i, base, 4);
      return i;
    }
    case core::DType::Int64: {
      int64_t i;
      std::memcpy(&i, base, 8);
      return static_cast<double>(i);
    }
    default:
      return std::numeric_limits<double>::quiet_NaN();
  }
}

// Entry i of a 1-D index tensor, or entry (axis, i) of M-RoPE's [3, T] positions.
int64_t read_index(const core::TensorArg& t, int64_t i, int64_t axis = 0) {
  const int64_t at = t.ndim == 2 ? axis * t.strides[0] + i * t.strides[1] : i * t.strides[0];
  const auto* base = static_cast<const unsigned char*>(t.data) + at * t.itemsize;
  if (t.dtype == core::DType::Int64) {
    int64_t v;
    std::memcpy(&v, base, 8);
    return v;
  }
  int32_t v;
  std::memcpy(&v, base, 4);
  return v;
}

// x rounded to the tensor dtype `dt` (nearest even), as a float.
float round_to(core::DType dt, float x) {
  if (dt == core::DType::Float16) return half_to_float(float_to_half(x));
  if (dt == core::DType::BFloat16) return bf16_to_float(float_to_bf16(x));
  return x;
}

}  // namespace

std::vector<float> rms_norm_head(const std::vector<float>& x, const core::TensorArg& weight, core::DType dt, double eps,
                                 double offset) {
  const size_t n = x.size();
  // Pairwise sum of squares over n padded with zeros to a power of two (docs/contract.md): a binary counter keeps one
  // partial sum per completed block, and the leftover blocks add up from the smallest, as the padded tree sums them.
  float stack[16];
  int depth = 0;
  for (size_t d = 0; d < n; ++d) {
    float s = x[d] * x[d];
    for (size_t m = d + 1; m % 2 == 0; m /= 2) s = stack[--depth] + s;
    stack[depth++] = s;
  }
  float ss = depth ? stack[--depth] : 0.f;
  while (depth > 0) ss = stack[--depth] + ss;
  const float mean = ss / static_cast<float>(n);
  const float sum = mean + static_cast<float>(eps);
  const float inv = 1.0f / std::sqrt(sum);
  const float off = static_cast<float>(offset);
  std::vector<float> y(n);
  for (size_t d = 0; d < n; ++d) {
    const float w = static_cast<float>(read_scalar(weight, static_cast<int64_t>(d) * weight.strides[0]));
    const float normalized = x[d] * inv;
    if (off == 0.f) {
      const float rounded = round_to(dt, normalized);
      y[d] = round_to(dt, rounded * w);
    } else {
      const float scale = off + w;
      y[d] = round_to(dt, normalized * scale);
    }
  }
  return y;
}

double read_element(const core::TensorArg& t, int64_t i0, int64_t i1, int64_t i2) {
  return read_scalar(t, i0 * t.strides[0] + i1 * t.strides[1] + i2 * t.strides[2]);
}

RopePoolReference rope_pool_reference(const core::RopePoolArgs& a) {
  const int64_t T = a.q.size(0), D = a.head_dim, rot = a.rot(), half = rot / 2;
  const int64_t hq = a.num_qo_heads, hkv = a.num_kv_heads;
  RopePoolReference r;
  r.q_rot.resize(static_cast<size_t>(T * hq * D));
  r.k_rot.resize(static_cast<size_t>(T * hkv * D));
  r.q_in.resize(r.q_rot.size());
  r.k_in.resize(r.k_rot.size());
  r.pos_ok.assign(static_cast<size_t>(T), true);
  const int64_t slots = a.has_pool ? core::pool_geometry(a.k_pool, a.kv_layout).slots : 0;
  r.pool_writer.assign(static_cast<size_t>(slots), -1);
  const std::vector<float> inv_freq = core::rope_inv_freq(a.rope_base, rot);
  std::vector<double> c(static_cast<size_t>(half)), s(static_cast<size_t>(half));

  for (int64_t t = 0; t < T; ++t) {
    // M-RoPE: frequency i rotates by its axis's position; a token with any
    // position outside the table is NaN throughout
    int64_t axis_pos[3];
    bool ok = true;
    for (int axis = 0; axis < 3; ++axis) {
      axis_pos[axis] = a.has_positions ? read_index(a.positions, t, a.has_mrope_section ? axis : 0) : t;
      if (a.has_cache) ok = ok && axis_pos[axis] >= 0 && axis_pos[axis] < a.cos_sin_cache.size(0);
    }
    const int kind = !a.has_mrope_section ? 0 : a.mrope_interleaved ? 2 : 1;
    for (int64_t i = 0; i < half; ++i) {
      const int64_t pos = kind == 0
                              ? axis_pos[0]
                              : axis_pos[rope_mrope_axis(kind, static_cast<int>(a.mrope_section[0]),
                                                         static_cast<int>(a.mrope_section[1]),
                                                         static_cast<int>(a.mrope_section[2]), static_cast<int>(i))];
      if (a.has_cache) {
        const double nan = std::numeric_limits<double>::quiet_NaN();
        c[i] = ok ? read_scalar(a.cos_sin_cache, pos * a.cos_sin_cache.strides[0] + i) : nan;
        s[i] = ok ? read_scalar(a.cos_sin_cache, pos * a.cos_sin_cache.strides[0] + half + i) : nan;
      } else {
        const float angle = static_cast<float>(pos) * inv_freq[i];  // one float32 rounding
        c[i] = std::cos(static_cast<double>(angle));
        s[i] = std::sin(static_cast<double>(angle));
      }
    }
    r.pos_ok[t] = ok;
    // the head (normalized first when its weight is given), then rotated in float64
    auto rotate = [&](const core::TensorArg& x, int64_t heads, bool norm, const core::TensorArg& weight,
                      std::vector<double>& out, std::vector<float>& rotated) {
      std::vector<float> in(static_cast<size_t>(D));
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t d = 0; d < D; ++d) in[d] = static_cast<float>(read_element(x, t, h, d));
        if (norm) in = rms_norm_head(in, weight, x.dtype, a.norm_eps, a.norm_offset);
        double* o = &out[static_cast<size_t>((t * heads + h) * D)];
        for (int64_t d = 0; d < D; ++d) o[d] = rotated[static_cast<size_t>((t * heads + h) * D + d)] = in[d];
        for (int64_t i = 0; i < half; ++i) {
          const int64_t i1 = a.is_neox ? i : 2 * i, i2 = a.is_neox ? i + half : 2 * i + 1;
          const double x1 = in[i1], x2 = in[i2];
          o[i1] = x1 * c[i] - x2 * s[i];
          o[i2] = x2 * c[i] + x1 * s[i];
        }
      }
    };
    rotate(a.q, hq, a.has_q_norm, a.q_norm_weight, r.q_rot, r.q_in);
    rotate(a.k, hkv, a.has_k_norm, a.k_norm_weight, r.k_rot, r.k_in);
    const int64_t slot = a.has_pool ? read_index(a.slots, t) : -1;
    if (ok && slot >= 0 && slot < slots) r.pool_writer[static_cast<size_t>(slot)] = t;
  }
  return r;
}

MlaReference mla_rope_pool_reference(const core::MlaRopeArgs& a) {
  const int64_t T = a.q.size(0), heads = a.q.size(1), R = a.k_pe.size(1), L = a.kv_c.size(1);
  core::RopePoolArgs r;
  r.q = a.q;  // its last R elements of every head
  r.q.shape[2] = R;
  r.q.data = static_cast<unsigned char*>(a.q.data) + (a.q.size(2) - R) * a.q.itemsize;
  r.k = core::TensorArg(a.k_pe);  // [T, 1, R]
  r.k.ndim = 3;
  r.k.shape[1] = 1;
  r.k.shape[2] = R;
  r.k.strides[1] = R;
  r.k.strides[2] = a.k_pe.strides[1];
  r.positions = a.positions;
  r.has_pool = false;
  r.has_cache = a.has_cache;
  r.cos_sin_cache = a.cos_sin_cache;
  r.rope_base = a.rope_base;
  r.is_neox = a.is_neox;
  r.head_dim = R;
  r.num_qo_heads = heads;
  r.num_kv_heads = 1;
  MlaReference m;
  m.rope = rope_pool_reference(r);
  m.latent.resize(static_cast<size_t>(T * L));
  std::vector<float> row(static_cast<size_t>(L));
  m.cache_writer.assign(static_cast<size_t>(core::mla_cache_slots(a.kv_cache)), -1);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < L; ++e) row[static_cast<size_t>(e)] = static_cast<float>(read_element(a.kv_c, t, e, 0));
    const std::vector<float> y = a.has_norm ? rms_norm_head(row, a.kv_norm_weight, a.kv_c.dtype, a.norm_eps, 0.0) : row;
    std::copy(y.begin(), y.end(), m.latent.begin() + t * L);
    const int64_t slot = read_index(a.slots, t);
    if (m.rope.pos_ok[static_cast<size_t>(t)] && slot >= 0 && slot < static_cast<int64_t>(m.cache_writer.size()))
      m.cache_writer[static_cast<size_t>(slot)] = t;
  }
  return m;
}

}  // namespace attnprep::cpu
