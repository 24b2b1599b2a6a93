#include "core/strided_copy.h"

#include <cstdint>

namespace attnprep::core {
namespace {

bool aligned(int64_t v, int64_t a) { return v % a == 0; }

bool job_allows(const CopyJob& job, int64_t vec) {
  // A vector must not straddle source elements that are not adjacent.
  if (job.src_elem_stride != job.itemsize && vec > job.itemsize) return false;
  if (!aligned(job.row_bytes, vec)) return false;
  if (!aligned(reinterpret_cast<uintptr_t>(job.src), vec) || !aligned(reinterpret_cast<uintptr_t>(job.dst), vec))
    return false;
  for (int d = 0; d < kCopyDims; ++d)
    if (!aligned(job.src_stride[d], vec) || !aligned(job.dst_stride[d], vec)) return false;
  return true;
}

}  // namespace

StridedCopyPlan plan_strided_copy(const CopyJob* jobs, int njobs) {
  StridedCopyPlan plan;
  plan.njobs = njobs;

  int64_t vec = 16;
  for (; vec > 1; vec /= 2) {
    bool ok = true;
    for (int j = 0; j < njobs && ok; ++j) ok = job_allows(jobs[j], vec);
    if (ok) break;
  }
  // Non-unit element strides copy one element per step, never less.
  for (int j = 0; j < njobs; ++j)
    if (jobs[j].src_elem_stride != jobs[j].itemsize && vec < jobs[j].itemsize) vec = jobs[j].itemsize;
  plan.vec_bytes = static_cast<int32_t>(vec);

  bool small = true;
  for (int j = 0; j < njobs; ++j) {
    const CopyJob& in = jobs[j];
    CopyJobPlan& out = plan.jobs[j];
    out.src = static_cast<const unsigned char*>(in.src);
    out.dst = static_cast<unsigned char*>(in.dst);
    out.total = 1;
    for (int d = 0; d < kCopyDims; ++d) {
      out.src_stride[d] = in.src_stride[d];
      out.dst_stride[d] = in.dst_stride[d];
      out.dims[d] = in.dims[d];
      out.total *= in.dims[d];
    }
    const bool elementwise = in.src_elem_stride != in.itemsize;
    out.dims[kCopyDims] = in.row_bytes / vec;
    out.src_vec_stride = elementwise ? in.src_elem_stride : vec;
    out.total *= out.dims[kCopyDims];
    if (out.total > plan.max_total) plan.max_total = out.total;
    for (int d = 0; d <= kCopyDims; ++d) {
      // Divisors are only used on the 32-bit path, where every dim is < 2^31.
      if (out.dims[d] >= (int64_t{1} << 31)) small = false;
      out.div[d] =
          FastDivmod(static_cast<uint32_t>(out.dims[d] > 0 && out.dims[d] < (int64_t{1} << 31) ? out.dims[d] : 1));
    }
    if (out.total >= (int64_t{1} << 31)) small = false;
  }
  plan.index_bits = small ? 32 : 64;
  return plan;
}

CopyCudaLaunch plan_copy_cuda_launch(const StridedCopyPlan& plan) {
  CopyCudaLaunch l;
  if (plan.max_total == 0 || plan.njobs == 0) return l;
  using P = CopyCudaPolicy;
  l.small = plan.max_total * plan.njobs < P::small_below;
  l.threads = l.small ? P::small_threads : P::large_threads;
  l.vectors_per_thread = l.small ? 1 : P::large_vectors_per_thread;
  const int64_t per_block = int64_t{l.threads} * l.vectors_per_thread;
  const int64_t chunks = (plan.max_total + per_block - 1) / per_block;
  l.grid_x = l.small ? chunks : chunks * plan.njobs;
  l.grid_y = l.small ? plan.njobs : 1;
  return l;
}

}  // namespace attnprep::core
