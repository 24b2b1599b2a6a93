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
  // The bounds test keeps the parameter arithmetic above the wait (without
  // it the compiler hoists the wait above it): with PDL it overlaps the
  // kernel before.
  const bool has = i < p.total;
  int which = 0;
  int64_t from = 0;
  if (has) core::pack_flat_source(p, static_cast<uint32_t>(i), which, from);
  wait_for_prior_kernels();  // cuda/launch.h: before any global memory access
  if (has) reinterpret_cast<uint4*>(p.out)[i] = __ldg(reinterpret_cast<const uint4*>(p.src[which] + from));
}

}  // namespace

cudaError_t pack_flat(const core::PackFlatPlan& plan, cudaStream_t stream) {
  if (plan.total == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((plan.total + kThreads - 1) / kThreads);
  return launch_kernel(pack_flat_kernel, dim3(blocks), dim3(kThreads), stream, plan);
}

}  // namespace attnprep::cuda
