#include "core/pack_qkv.h"

#include "core/errors.h"
#include "core/overlap.h"

#include <algorithm>

namespace attnprep::core {

PackQkvShape check_pack_qkv_inputs(const TensorArg& q, const TensorArg& k, const TensorArg& v, int64_t world_size) {
  const auto dtypes = [&] { return dtype_device_note({{"q", &q}, {"k", &k}, {"v", &v}}); };
  require(q.ndim == 3 && q.same_shape(k) && q.same_shape(v), "q, k, and v must have the same 3D shape",
          [&] { return shape_note({{"q", &q}, {"k", &k}, {"v", &v}}); });
  require(q.device.type == DeviceType::CUDA && k.device.type == DeviceType::CUDA && v.device.type == DeviceType::CUDA,
          "q, k, and v must be CUDA tensors", dtypes);
  require(q.device == k.device && q.device == v.device && q.dtype == k.dtype && q.dtype == v.dtype &&
              q.itemsize == k.itemsize && q.itemsize == v.itemsize,
          "q, k, and v must have the same device and dtype", dtypes);
  require(q.stride(-1) == 1 && k.stride(-1) == 1 && v.stride(-1) == 1, "q, k, and v must be contiguous in head_size",
          [&] {
            return "last-dimension strides: q " + std::to_string(q.stride(-1)) + ", k " + std::to_string(k.stride(-1)) +
                   ", v " + std::to_string(v.stride(-1));
          });
  require(world_size >= 1 && q.size(1) % world_size == 0, "world_size must be positive and divide global_heads",
          [&] { return "world_size: " + std::to_string(world_size) + ", global_heads: " + std::to_string(q.size(1)); });

  PackQkvShape s{};
  s.world_size = world_size;
  s.rows = q.size(0);
  s.global_heads = q.size(1);
  s.local_heads = s.global_heads / world_size;
  s.head_size = q.size(2);
  s.fits = fits_int64_bytes({world_size, s.rows, s.local_heads, 3, s.head_size}, q.itemsize);
  // An output past int64 has no shape a tensor could have: -1 matches none (check 6).
  s.out_shape[0] = s.fits ? world_size : -1;
  s.out_shape[1] = s.fits ? s.rows : -1;
  s.out_shape[2] = s.fits ? s.local_heads : -1;
  s.out_shape[3] = s.fits ? 3 * s.head_size : -1;
  return s;
}

void check_pack_qkv_output_size(const PackQkvShape& s) {
  require(s.fits, "q, k, and v are too large: the output would exceed 2^63 - 1 bytes");
}

void check_pack_qkv_out(const PackQkvShape& s, const TensorArg& q, const TensorArg& k, const TensorArg& v,
                        const TensorArg& out) {
  require(out.has_shape({s.out_shape[0], s.out_shape[1], s.out_shape[2], s.out_shape[3]}) && out.is_contiguous() &&
              out.device == q.device && out.dtype == q.dtype && out.itemsize == q.itemsize,
          "out must be a contiguous tensor with the expected shape, device, and dtype", [&] {
            std::string want = "torch.Size([";
            for (int d = 0; d < 4; ++d) want += (d ? ", " : "") + std::to_string(s.out_shape[d]);
            return "expected " + want + "]) " + dtype_name(q.dtype) + " on " + device_str(q.device) +
                   ", contiguous; got " + shape_str(out) + " " + dtype_name(out.dtype) + " on " +
                   device_str(out.device) + (out.is_contiguous() ? "" : ", not contiguous");
          });
  require(!may_overlap(out, q) && !may_overlap(out, k) && !may_overlap(out, v), "out must not overlap q, k, or v");
}

StridedCopyPlan plan_pack_qkv(const PackQkvShape& s, const TensorArg& q, const TensorArg& k, const TensorArg& v,
                              const TensorArg& out) {
  const int64_t es = q.itemsize;
  const int64_t out_row = 3 * s.head_size * es;  // bytes of one (d, r, h) output row
  CopyJob jobs[3];
  const TensorArg* src[3] = {&q, &k, &v};
  for (int j = 0; j < 3; ++j) {
    const TensorArg& t = *src[j];
    CopyJob& job = jobs[j];
    job.src = t.data;
    job.dst = static_cast<unsigned char*>(out.data) + j * s.head_size * es;
    // output (d, r, h) -> source row r, head d * local_heads + h, walked in output order: DRAM serves scattered reads
    // better than scattered writes.
    const int64_t dims[kCopyDims] = {1, s.world_size, s.rows, s.local_heads};
    const int64_t src_stride[kCopyDims] = {0, s.local_heads * t.byte_stride(1), t.byte_stride(0), t.byte_stride(1)};
    const int64_t dst_stride[kCopyDims] = {0, s.rows * s.local_heads * out_row, s.local_heads * out_row, out_row};
    for (int d = 0; d < kCopyDims; ++d) {
      job.dims[d] = dims[d];
      job.src_stride[d] = src_stride[d];
      job.dst_stride[d] = dst_stride[d];
    }
    job.row_bytes = s.head_size * es;
    job.src_elem_stride = es;  // unit stride in head_size is checked
    job.itemsize = static_cast<int32_t>(es);
  }
  return plan_strided_copy(jobs, 3);
}

bool plan_pack_flat(const PackQkvShape& s, const TensorArg& q, const TensorArg& k, const TensorArg& v,
                    const TensorArg& out, PackFlatPlan& p) {
  const int64_t es = q.itemsize, row_bytes = s.head_size * es;
  const int64_t total = s.world_size * s.rows * s.local_heads * 3 * row_bytes / 16;
  if (row_bytes % 16 != 0 || total == 0 || total > INT32_MAX) return false;
  if (reinterpret_cast<uintptr_t>(out.data) % 16 != 0) return false;
  const TensorArg* src[3] = {&q, &k, &v};
  for (int j = 0; j < 3; ++j) {
    const TensorArg& t = *src[j];
    const int64_t row_stride = t.byte_stride(0), head_stride = t.byte_stride(1);
    const auto fits = [](int64_t x) { return x >= INT32_MIN && x <= INT32_MAX; };
    if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0 || row_stride % 16 != 0 || head_stride % 16 != 0 ||
        !fits(row_stride) || !fits(head_stride))
      return false;
    p.src[j] = static_cast<const unsigned char*>(t.data);
    p.row_stride[j] = static_cast<int32_t>(row_stride);
    p.head_stride[j] = static_cast<int32_t>(head_stride);
  }
  p.out = static_cast<unsigned char*>(out.data);
  p.total = static_cast<int32_t>(total);  // every factor below is then under 2^31 too
  p.rows = static_cast<int32_t>(s.rows);
  p.by_row3 = FastDivmod(static_cast<uint32_t>(3 * row_bytes / 16));
  p.by_seg = FastDivmod(static_cast<uint32_t>(row_bytes / 16));
  p.by_local = FastDivmod(static_cast<uint32_t>(s.local_heads));
  p.by_inner = FastDivmod(static_cast<uint32_t>(pack_flat_walks_inputs(total) ? s.world_size : s.rows));
  return true;
}

void check_ulysses_geometry(const TensorArg& q, const TensorArg& k, const TensorArg& v, int64_t world_size) {
  require(q.ndim == 3 && k.ndim == 3 && k.same_shape(v) && k.size(0) == q.size(0) && k.size(2) == q.size(2),
          "ulysses: q must be [rows, heads, head_dim] and k, v [rows, kv_heads, head_dim]");
  require(world_size >= 1 && q.size(1) % world_size == 0, "ulysses: world_size must divide the number of q heads");
  const int64_t kv = k.size(1);
  require(kv >= 1 && q.size(1) % kv == 0 && (kv % world_size == 0 || world_size % kv == 0),
          "ulysses: kv_heads must divide the q heads, and divide or be a multiple of world_size");
  require(q.device == k.device && q.device == v.device, "ulysses: q, k and v must be on one device");
  require(q.dtype == k.dtype && q.dtype == v.dtype && q.itemsize == k.itemsize && q.itemsize == v.itemsize,
          "ulysses: q, k and v must have one dtype");
  // The send buffer, world * rows * (local q + 2 local kv heads) * head_dim,
  // is the largest the layer allocates (the output is world * rows * local q).
  const int64_t local_q = q.size(1) / world_size, local_kv = kv >= world_size ? kv / world_size : 1;
  require(local_kv <= (INT64_MAX - local_q) / 2 &&
              fits_int64_bytes({world_size, q.size(0), local_q + 2 * local_kv, q.size(2)}, q.itemsize),
          "ulysses: q, k and v are too large: the exchange buffers would exceed 2^63 - 1 bytes");
}

void check_ulysses_batched(const TensorArg& q, const TensorArg& k, const TensorArg& v, const TensorArg* mask) {
  require(q.ndim == 4 && k.ndim == 4 && k.same_shape(v) && k.size(0) == q.size(0) && k.size(1) == q.size(1) &&
              k.size(3) == q.size(3) && k.size(2) > 0,
          "ulysses: q must be [batch, rows, heads, head_dim] and k, v [batch, rows, kv_heads, head_dim]");
  require(q.size(2) % k.size(2) == 0, "ulysses: kv_heads must divide the q heads");
  require(q.device == k.device && q.device == v.device, "ulysses: q, k and v must be on one device");
  require(q.dtype == k.dtype && q.dtype == v.dtype && q.itemsize == k.itemsize && q.itemsize == v.itemsize,
          "ulysses: q, k and v must have one dtype");
  if (mask)
    require(mask->dtype == DType::Bool && mask->ndim == 2 && mask->size(0) == q.size(0) && mask->size(1) == q.size(1) &&
                mask->device == q.device,
            "ulysses: key_padding_mask must be a bool tensor [batch, rows] on q's device");
}

void check_ulysses_chunks(int64_t local_q, int64_t local_kv, bool kv_split, int64_t chunks) {
  require(chunks >= 1 && local_q % chunks == 0 && (!kv_split || local_kv % chunks == 0),
          "ulysses: chunks must be positive and divide each rank's q heads (and its kv heads when they are split)");
}

namespace {
// [S, B, H, D] as the 3-D [S * B, H, D] the checks read (rows (s, b), row-major; the row stride is not read).
TensorArg folded_rows(const TensorArg& t) {
  TensorArg r = t;
  r.ndim = 3;
  r.shape[0] = t.size(0) * t.size(1);
  r.shape[1] = t.size(2);
  r.shape[2] = t.size(3);
  r.strides[0] = 0;
  r.strides[1] = t.stride(2);
  r.strides[2] = t.stride(3);
  return r;
}
}  // namespace

PackGqaShape check_pack_qkv_gqa(const TensorArg& q4, const TensorArg& k4, const TensorArg& v4, int64_t world_size,
                                int64_t chunks) {
  // Internal: [S, B, H, D] inputs (the batched layer's rows (s, b)) with one chunk; other 4-D inputs meet the
  // geometry check's message.
  const bool two_row_dims = q4.ndim == 4 && k4.ndim == 4 && v4.ndim == 4 && chunks == 1 && k4.size(0) == q4.size(0) &&
                            k4.size(1) == q4.size(1) && v4.size(0) == q4.size(0) && v4.size(1) == q4.size(1);
  const TensorArg q = two_row_dims ? folded_rows(q4) : q4, k = two_row_dims ? folded_rows(k4) : k4,
                  v = two_row_dims ? folded_rows(v4) : v4;
  check_ulysses_geometry(q, k, v, world_size);
  require(q.device.type == DeviceType::CUDA, "ulysses: q, k and v must be on one CUDA device");
  require(q.stride(-1) == 1 && k.stride(-1) == 1 && v.stride(-1) == 1,
          "ulysses: q, k and v must be contiguous in head_dim");
  const int64_t kv = k.size(1);
  PackGqaShape s{};
  s.world_size = world_size;
  s.rows = q.size(0);
  s.batch = two_row_dims ? q4.size(1) : 0;
  s.heads = q.size(1);
  s.kv_heads = kv;
  s.head_size = q.size(2);
  s.local_q = s.heads / world_size;
  s.local_kv = kv >= world_size ? kv / world_size : 1;
  check_ulysses_chunks(s.local_q, s.local_kv, kv >= world_size, chunks);
  s.chunks = chunks;
  s.chunk_q = s.local_q / chunks;
  s.chunk_kv = kv >= world_size ? s.local_kv / chunks : 1;
  s.out_shape[0] = chunks;
  s.out_shape[1] = world_size;
  s.out_shape[2] = s.rows;
  s.out_shape[3] = (s.chunk_q + 2 * s.chunk_kv) * s.head_size;
  return s;
}

StridedCopyPlan plan_pack_qkv_gqa(const PackGqaShape& s, const TensorArg& q, const TensorArg& k, const TensorArg& v,
                                  const TensorArg& out) {
  const int64_t es = q.itemsize, row = s.head_size * es;
  const int64_t out_row = s.out_shape[3] * es;  // bytes for one (chunk, destination, row)
  const int64_t per_dest = s.rows * out_row, per_chunk = s.world_size * per_dest;
  CopyJob jobs[3];
  const TensorArg* src[3] = {&q, &k, &v};
  const int64_t offset[3] = {0, s.chunk_q * row, (s.chunk_q + s.chunk_kv) * row};
  for (int j = 0; j < 3; ++j) {
    const TensorArg& t = *src[j];
    CopyJob& job = jobs[j];
    job.src = t.data;
    job.dst = static_cast<unsigned char*>(out.data) + offset[j];
    job.row_bytes = row;
    job.src_elem_stride = es;
    job.itemsize = static_cast<int32_t>(es);
    const bool two = s.batch > 0;  // rows (s, b) of [S, B, H, D]: one chunk, the chunk dimension free for b
    const int64_t hs = t.byte_stride(two ? 2 : 1), rs = t.byte_stride(0), bs = two ? t.byte_stride(1) : 0;
    const int64_t S = two ? t.size(0) : 0, B = s.batch;
    int64_t dims[kCopyDims], ss[kCopyDims], ds[kCopyDims];
    if (two && (j == 0 || s.kv_heads >= s.world_size)) {
      const int64_t local = j == 0 ? s.local_q : s.local_kv;
      const int64_t d_[kCopyDims] = {s.world_size, S, B, local};
      const int64_t s_[kCopyDims] = {local * hs, rs, bs, hs};
      const int64_t t_[kCopyDims] = {per_dest, B * out_row, out_row, row};
      std::copy(d_, d_ + kCopyDims, dims);
      std::copy(s_, s_ + kCopyDims, ss);
      std::copy(t_, t_ + kCopyDims, ds);
    } else if (two) {
      const int64_t rep = s.world_size / s.kv_heads;
      const int64_t d_[kCopyDims] = {s.kv_heads, rep, S, B};
      const int64_t s_[kCopyDims] = {hs, 0, rs, bs};
      const int64_t t_[kCopyDims] = {rep * per_dest, per_dest, B * out_row, out_row};
      std::copy(d_, d_ + kCopyDims, dims);
      std::copy(s_, s_ + kCopyDims, ss);
      std::copy(t_, t_ + kCopyDims, ds);
    } else if (j == 0 || s.kv_heads >= s.world_size) {
      // chunk c of destination d: heads d * local + c * per_chunk + [0, per_chunk)
      const int64_t local = j == 0 ? s.local_q : s.local_kv, chunk = j == 0 ? s.chunk_q : s.chunk_kv;
      const int64_t d_[kCopyDims] = {s.chunks, s.world_size, s.rows, chunk};
      const int64_t s_[kCopyDims] = {chunk * hs, local * hs, rs, hs};
      const int64_t t_[kCopyDims] = {per_chunk, per_dest, out_row, row};
      std::copy(d_, d_ + kCopyDims, dims);
      std::copy(s_, s_ + kCopyDims, ss);
      std::copy(t_, t_ + kCopyDims, ds);
    } else {
      // destination d = a * rep + b takes kv head a, in every chunk: strides of zero repeat it
      const int64_t rep = s.world_size / s.kv_heads;
      const int64_t d_[kCopyDims] = {s.chunks, s.kv_heads, rep, s.rows};
      const int64_t s_[kCopyDims] = {0, hs, 0, rs};
      const int64_t t_[kCopyDims] = {per_chunk, rep * per_dest, per_dest, out_row};
      std::copy(d_, d_ + kCopyDims, dims);
      std::copy(s_, s_ + kCopyDims, ss);
      std::copy(t_, t_ + kCopyDims, ds);
    }
    for (int d = 0; d < kCopyDims; ++d) {
      job.dims[d] = dims[d];
      job.src_stride[d] = ss[d];
      job.dst_stride[d] = ds[d];
    }
  }
  return plan_strided_copy(jobs, 3);
}

}  // namespace attnprep::core
