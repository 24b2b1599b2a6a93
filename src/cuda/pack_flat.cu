#include "cuda/pack_flat.h"

#include "cuda/copy_loads.cuh"
#include "cuda/launch.h"

#include <cstdint>

namespace attnprep::cuda {
namespace {

using core::CopyCudaPolicy;

template <bool kInputOrder>
constexpr int kThreads = kInputOrder ? CopyCudaPolicy::flat_input_threads : CopyCudaPolicy::flat_threads;

// One 16-byte vector of the pack per thread, the walk of core::pack_flat_step.
// A small pack (output order) is launched with PDL; a large one (input
// order) without, and its loads carry the large copies' L2 evict-last policy.
template <bool kInputOrder>
__global__ void __launch_bounds__(kThreads<kInputOrder>) pack_flat_kernel(const __grid_constant__ core::PackFlatPlan p) {
  // The next kernel on the stream may start placing its work while this one copies.
  if constexpr (!kInputOrder) let_next_kernel_start();
  const uint32_t i = blockIdx.x * kThreads<kInputOrder> + threadIdx.x;  // total < 2^31
  // The source address, with its reads of the parameter bank, is complete
  // before the wait: with PDL it overlaps the kernel before, instead of
  // adding parameter-bank round trips to the call's critical path after
  // it. Computed for every thread (a thread past the end takes the last
  // vector's), so that the count and the divisors are read together at
  // entry rather than the divisors behind a bounds test (PackFlatPlan);
  // inside a branch that is always taken (i < 2^31) and tests no parameter,
  // which ptxas does not move the reads out of (computed unconditionally,
  // they sink below the wait).
  const bool has = i < static_cast<uint32_t>(p.total);
  const uint4* src = nullptr;
  uint32_t to = 0;
  if (i != UINT32_MAX) {
    int which;
    int64_t from;
    core::pack_flat_step<kInputOrder>(p, has ? i : static_cast<uint32_t>(p.total) - 1, which, from, to);
    src = reinterpret_cast<const uint4*>(p.src[which] + from);
  }
  if constexpr (!kInputOrder) wait_for_prior_kernels();  // cuda/launch.h: before any global memory access
  if (has) reinterpret_cast<uint4*>(p.out)[kInputOrder ? to : i] = load<uint4, kInputOrder>(src);
}

}  // namespace

cudaError_t pack_flat(const core::PackFlatPlan& plan, cudaStream_t stream) {
  if (plan.total <= 0) return cudaSuccess;
  if (core::pack_flat_walks_inputs(plan.total)) {
    constexpr int kT = kThreads<true>;
    const unsigned blocks = static_cast<unsigned>((int64_t{plan.total} + kT - 1) / kT);
    return launch_kernel_without_pdl(pack_flat_kernel<true>, dim3(blocks), dim3(kT), stream, plan);
  }
  constexpr int kT = kThreads<false>;
  const unsigned blocks = static_cast<unsigned>((plan.total + kT - 1) / kT);
  return launch_kernel(pack_flat_kernel<false>, dim3(blocks), dim3(kT), stream, plan);
}

}  // namespace attnprep::cuda
