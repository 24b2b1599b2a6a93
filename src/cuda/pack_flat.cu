#include "cuda/pack_flat.h"

#include "cuda/launch.h"

#include <cstdint>

namespace attnprep::cuda {
namespace {

constexpr int kThreads = core::CopyCudaPolicy::small_threads;

// One 16-byte vector of the output per thread, in output order.
__global__ void __launch_bounds__(kThreads) pack_flat_kernel(const __grid_constant__ core::PackFlatPlan p) {
  // The next kernel on the stream may start placing its work while this one copies.
  let_next_kernel_start();
  const int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  // The source address, with its read of src[which] from the parameter
  // bank (a different word for each third of a warp), is complete before
  // the wait: with PDL it overlaps the kernel before, instead of adding a
  // parameter-bank round trip to the call's critical path after it. The
  // bounds test keeps it there (without it the compiler sinks the read
  // below the wait).
  const bool has = i < p.total;
  const uint4* src = nullptr;
  if (has) {
    int which;
    int64_t from;
    core::pack_flat_source(p, static_cast<uint32_t>(i), which, from);
    src = reinterpret_cast<const uint4*>(p.src[which] + from);
  }
  wait_for_prior_kernels();  // cuda/launch.h: before any global memory access
  if (has) reinterpret_cast<uint4*>(p.out)[i] = __ldg(src);
}

}  // namespace

cudaError_t pack_flat(const core::PackFlatPlan& plan, cudaStream_t stream) {
  if (plan.total == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((plan.total + kThreads - 1) / kThreads);
  return launch_kernel(pack_flat_kernel, dim3(blocks), dim3(kThreads), stream, plan);
}

}  // namespace attnprep::cuda
