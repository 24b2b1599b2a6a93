#include "cuda/pack_flat.h"

#include "cuda/copy_loads.cuh"
#include "cuda/launch.h"

#include <cstdint>

namespace attnprep::cuda {
namespace {

using core::CopyCudaPolicy;

template <bool kInputOrder>
constexpr int kThreads = kInputOrder ? CopyCudaPolicy::flat_input_threads : CopyCudaPolicy::flat_threads;
// A small pack (output order) is launched with PDL; a large one (input
// order) as the large copies are, and its loads carry their L2 policy.
template <bool kInputOrder>
constexpr bool kPdl = !kInputOrder || CopyCudaPolicy::large_with_pdl;
template <bool kInputOrder>
constexpr bool kEvictLast = kInputOrder && CopyCudaPolicy::large_loads_evict_last;

// One 16-byte vector of the pack per thread, the walk of core::pack_flat_step.
template <bool kInputOrder>
__global__ void __launch_bounds__(kThreads<kInputOrder>)
    pack_flat_kernel(const __grid_constant__ core::PackFlatPlan p) {
  // The next kernel on the stream may start placing its work while this one copies.
  if constexpr (kPdl<kInputOrder>) let_next_kernel_start();
  const uint32_t i = blockIdx.x * kThreads<kInputOrder> + threadIdx.x;  // total < 2^31
  // The source address (its parameter-bank reads) is complete before the wait, so with PDL it overlaps the kernel
  // before; computed for every thread inside an always-taken branch so that ptxas neither sinks the reads below the
  // wait nor puts the divisors behind the bounds test.
  const bool has = i < static_cast<uint32_t>(p.total);
  const uint4* src = nullptr;
  uint32_t to = 0;
  if (i != UINT32_MAX) {
    int which;
    int64_t from;
    core::pack_flat_step<kInputOrder>(p, has ? i : static_cast<uint32_t>(p.total) - 1, which, from, to);
    src = reinterpret_cast<const uint4*>(p.src[which] + from);
  }
  if constexpr (kPdl<kInputOrder>) wait_for_prior_kernels();  // cuda/launch.h: before any global memory access
  if (has) reinterpret_cast<uint4*>(p.out)[kInputOrder ? to : i] = load<uint4, kEvictLast<kInputOrder>>(src);
}

template <bool kInputOrder>
cudaError_t launch(const core::PackFlatPlan& plan, cudaStream_t stream) {
  constexpr int kT = kThreads<kInputOrder>;
  const dim3 grid(static_cast<unsigned>((int64_t{plan.total} + kT - 1) / kT));
  if constexpr (kPdl<kInputOrder>) return launch_kernel(pack_flat_kernel<kInputOrder>, grid, dim3(kT), stream, plan);
  return launch_kernel_without_pdl(pack_flat_kernel<kInputOrder>, grid, dim3(kT), stream, plan);
}

}  // namespace

cudaError_t pack_flat(const core::PackFlatPlan& plan, cudaStream_t stream) {
  if (plan.total <= 0) return cudaSuccess;
  return core::pack_flat_walks_inputs(plan.total) ? launch<true>(plan, stream) : launch<false>(plan, stream);
}

}  // namespace attnprep::cuda
