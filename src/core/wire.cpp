#include "core/wire.h"

namespace attnprep::core {
namespace {

int log2_exact(int64_t v) {  // -1 unless v is a power of two
  if (v <= 0 || (v & (v - 1)) != 0) return -1;
  int s = 0;
  while ((int64_t{1} << s) < v) ++s;
  return s;
}

}  // namespace

bool wire_kernel_applies(const StridedCopyPlan& plan, DType dtype, int64_t itemsize, int64_t head_size,
                         int64_t plain_blocks) {
  if (dtype != DType::Float16 && dtype != DType::BFloat16 && dtype != DType::Float32) return false;
  const int64_t block = head_size * itemsize;
  if (log2_exact(block) < 5 || block > 1024) return false;
  return plan.vec_bytes == 16 && plan.index_bits == 32 && plain_blocks < (int64_t{1} << 31);
}

WireMap make_wire_map(const void* plain_base, void* wire, int64_t blocks, int64_t head_size, int64_t itemsize) {
  WireMap m;
  m.plain_base = static_cast<const unsigned char*>(plain_base);
  m.wire = static_cast<unsigned char*>(wire);
  m.row_bytes = wire_row_bytes(blocks, head_size);
  m.values_bytes = blocks * head_size;
  m.head_size = static_cast<int32_t>(head_size);
  m.block_shift = log2_exact(head_size * itemsize);
  m.item_shift = log2_exact(itemsize);
  m.blocks = FastDivmod(static_cast<uint32_t>(blocks));
  return m;
}

StridedCopyPlan plan_wire_view(const TensorArg& x, const void* plain_base, bool to_plain) {
  const int64_t es = x.itemsize, row = x.size(3) * es;
  const int64_t n = x.size(2), b = x.size(1);
  CopyJob job;
  const int64_t view_stride[kCopyDims] = {0, x.byte_stride(0), x.byte_stride(1), x.byte_stride(2)};
  const int64_t plain_stride[kCopyDims] = {0, b * n * row, n * row, row};
  const int64_t dims[kCopyDims] = {1, x.size(0), b, n};
  for (int d = 0; d < kCopyDims; ++d) {
    job.dims[d] = dims[d];
    job.src_stride[d] = to_plain ? view_stride[d] : plain_stride[d];
    job.dst_stride[d] = to_plain ? plain_stride[d] : view_stride[d];
  }
  job.src = to_plain ? x.data : plain_base;
  job.dst = to_plain ? const_cast<void*>(plain_base) : x.data;
  job.row_bytes = row;
  job.src_elem_stride = to_plain && x.size(3) > 1 ? x.byte_stride(3) : es;
  job.itemsize = static_cast<int32_t>(es);
  return plan_strided_copy(&job, 1);
}

}  // namespace attnprep::core
