#include "core/usp_merge_heads.h"

#include <string>

#include "core/errors.h"

namespace attnprep::core {

void check_usp_merge_heads(const TensorArg& x, int64_t out_shape[5]) {
  if (x.ndim != 5) throw ValueError("usp_merge_heads expects x to be 5-D [W, S, B, h_local, D], got " + shape_str(x));
  require(x.device.type == DeviceType::CUDA, "usp_merge_heads expects a CUDA tensor");
  if (x.dtype != DType::Float16 && x.dtype != DType::BFloat16 && x.dtype != DType::Float32)
    throw ValueError(std::string("Unsupported usp_merge_heads dtype: ") + dtype_name(x.dtype));
  require(fits_int64_bytes({x.size(0), x.size(1), x.size(2), x.size(3), x.size(4)}, x.itemsize),
          "x is too large: the output would exceed 2^63 - 1 bytes");
  out_shape[0] = x.size(2);
  out_shape[1] = x.size(1);
  out_shape[2] = x.size(0);
  out_shape[3] = x.size(3);
  out_shape[4] = x.size(4);
}

StridedCopyPlan plan_usp_merge_heads(const TensorArg& x, const TensorArg& out) {
  const int64_t es = x.itemsize;
  CopyJob job;
  job.src = x.data;
  job.dst = out.data;
  // output coordinates (b, s, w, h) -> x[w, s, b, h]
  const int64_t dims[kCopyDims] = {x.size(2), x.size(1), x.size(0), x.size(3)};
  const int64_t src_stride[kCopyDims] = {x.byte_stride(2), x.byte_stride(1), x.byte_stride(0), x.byte_stride(3)};
  const int64_t row = x.size(4) * es;
  const int64_t dst_stride[kCopyDims] = {x.size(1) * x.size(0) * x.size(3) * row, x.size(0) * x.size(3) * row,
                                         x.size(3) * row, row};
  for (int d = 0; d < kCopyDims; ++d) {
    job.dims[d] = dims[d];
    job.src_stride[d] = src_stride[d];
    job.dst_stride[d] = dst_stride[d];
  }
  job.row_bytes = row;
  job.src_elem_stride = x.size(4) > 1 ? x.byte_stride(4) : es;
  job.itemsize = static_cast<int32_t>(es);
  return plan_strided_copy(&job, 1);
}

}  // namespace attnprep::core
