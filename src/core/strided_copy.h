// A launch plan for "gather rows", the engine of the layout ops: each job copies a 4-D grid of rows (`row_bytes`
// contiguous at the destination, evenly strided at the source). Byte-exact, so only the element size matters.
#pragma once

#include <cstdint>

#include "core/cuda_tuning.h"
#include "core/fast_divmod.h"

namespace attnprep::core {

constexpr int kCopyDims = 4;
constexpr int kMaxCopyJobs = 3;

// What an op asks for. Strides are in bytes.
struct CopyJob {
  const void* src = nullptr;
  void* dst = nullptr;
  int64_t dims[kCopyDims] = {1, 1, 1, 1};  // outer dims, outermost first
  int64_t src_stride[kCopyDims] = {};
  int64_t dst_stride[kCopyDims] = {};
  int64_t row_bytes = 0;        // bytes of one row at the destination
  int64_t src_elem_stride = 0;  // bytes between a row's elements at the source
  int32_t itemsize = 1;
};

// What a kernel executes: the jobs rewritten in units of `vec_bytes`, with the
// divisors precomputed. Fixed-width fields so the struct can be passed to a
// kernel by value.
struct CopyJobPlan {
  const unsigned char* src;
  unsigned char* dst;
  int64_t src_stride[kCopyDims];
  int64_t dst_stride[kCopyDims];
  int64_t src_vec_stride;         // bytes between consecutive vectors of a row
  int64_t total;                  // vectors in this job
  int64_t dims[kCopyDims + 1];    // outer dims + vectors per row
  FastDivmod div[kCopyDims + 1];  // same, for the 32-bit index path
};

struct StridedCopyPlan {
  CopyJobPlan jobs[kMaxCopyJobs];
  int32_t njobs = 0;
  int32_t vec_bytes = 1;    // 16, 8, 4, 2 or 1
  int32_t index_bits = 32;  // 32: every job's total < 2^31, fast divmod; else 64
  int64_t max_total = 0;    // launch grid covers this many vectors per job
};

// Where vector `idx` of a job is read from and written to (byte offsets).
// Shared by the CUDA kernel and the host-side plan tests, so CI checks the
// index arithmetic the GPU runs. Index32 uses the multiply-shift divisors.
template <bool Index32>
ATTNPREP_HD void copy_offsets(const CopyJobPlan& job, int64_t idx, int64_t vec_bytes, int64_t& src, int64_t& dst) {
  int64_t coord[kCopyDims + 1];
  if constexpr (Index32) {
    uint32_t n = static_cast<uint32_t>(idx);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int d = kCopyDims; d > 0; --d) {
      const uint32_t q = job.div[d].div(n);
      coord[d] = n - q * job.div[d].divisor;
      n = q;
    }
    coord[0] = n;
  } else {
    int64_t n = idx;
    for (int d = kCopyDims; d > 0; --d) {
      coord[d] = n % job.dims[d];
      n /= job.dims[d];
    }
    coord[0] = n;
  }
  src = coord[kCopyDims] * job.src_vec_stride;
  dst = coord[kCopyDims] * vec_bytes;
  for (int d = 0; d < kCopyDims; ++d) {
    src += coord[d] * job.src_stride[d];
    dst += coord[d] * job.dst_stride[d];
  }
}

// Picks the widest vector every address and stride allows and the index
// width. Jobs with no rows are kept (they copy nothing).
StridedCopyPlan plan_strided_copy(const CopyJob* jobs, int njobs);

// A large copy's blocks alternate between jobs (block b: job b % njobs) so that DRAM writes stay whole rows of the
// shared output; a small copy's blocks take their job from y, so no block's first parameter read waits for another.
struct CopyCudaLaunch {
  bool small = false;
  int32_t threads = 0;
  int32_t vectors_per_thread = 0;
  int64_t grid_x = 0, grid_y = 0;  // 0: nothing to launch
};
CopyCudaLaunch plan_copy_cuda_launch(const StridedCopyPlan& plan);

}  // namespace attnprep::core
