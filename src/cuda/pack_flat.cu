#include "cuda/pack_flat.h"

#include "cuda/launch.h"

#include <cstdint>

namespace attnprep::cuda {
namespace {

constexpr int kThreads = core::CopyCudaPolicy::flat_threads;

// One 16-byte vector of the output per thread, in output order.
__global__ void __launch_bounds__(kThreads) pack_flat_kernel(const __grid_constant__ core::PackFlatPlan p) {
  // The next kernel on the stream may start placing its work while this one copies.
  let_next_kernel_start();
  const uint32_t i = blockIdx.x * kThreads + threadIdx.x;  // total < 2^18
  // The source address, with its reads of the parameter bank, is complete
  // before the wait: with PDL it overlaps the kernel before, instead of
  // adding parameter-bank round trips to the call's critical path after
  // it. Computed for every thread (a thread past the end takes the last
  // vector's), so that the count and the divisors are read together at
  // entry rather than the divisors behind a bounds test (PackFlatPlan);
  // inside a branch that is always taken (i < 2^18) and tests no parameter,
  // which ptxas does not move the reads out of (computed unconditionally,
  // they sink below the wait).
  const bool has = i < static_cast<uint32_t>(p.total);
  const uint4* src = nullptr;
  if (i != UINT32_MAX) {
    int which;
    int64_t from;
    core::pack_flat_source(p, has ? i : static_cast<uint32_t>(p.total) - 1, which, from);
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
