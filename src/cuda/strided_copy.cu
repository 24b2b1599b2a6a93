#include "cuda/strided_copy.h"

#include "cuda/copy_loads.cuh"
#include "cuda/launch.h"

#include <cstdint>

namespace attnprep::cuda {
namespace {

using core::CopyCudaLaunch;
using core::CopyCudaPolicy;
using core::CopyJobPlan;
using core::StridedCopyPlan;

template <bool kSmall>
constexpr int kThreads = kSmall ? CopyCudaPolicy::small_threads : CopyCudaPolicy::large_threads;
template <bool kSmall>
constexpr int kVectors = kSmall ? 1 : CopyCudaPolicy::large_vectors_per_thread;
template <bool kSmall>
constexpr bool kPdl = kSmall || CopyCudaPolicy::large_with_pdl;

// One block copies kThreads * kVectors consecutive vectors of one job (core::plan_copy_cuda_launch). kOneJob: a
// large copy of one job reads its parameters at fixed offsets, with no division of the block index by the job
// count and no indexed parameter loads.
template <typename V, bool Index32, bool kSmall, bool kOneJob>
__global__ void __launch_bounds__(kThreads<kSmall>) strided_copy_kernel(const __grid_constant__ StridedCopyPlan plan) {
  constexpr int kT = kThreads<kSmall>, kU = kVectors<kSmall>;
  // Let the next kernel on the stream be scheduled right away: its blocks
  // then read their parameters while this one copies, which is most of what
  // a small call costs.
  if constexpr (kPdl<kSmall>) let_next_kernel_start();
  const unsigned njobs = kSmall || kOneJob ? 1u : static_cast<unsigned>(plan.njobs);
  const CopyJobPlan& job = plan.jobs[kSmall ? blockIdx.y : kOneJob ? 0u : blockIdx.x % njobs];
  const int64_t chunk = kOneJob ? blockIdx.x : blockIdx.x / njobs;
  const int64_t base = chunk * (kT * kU) + threadIdx.x;
  const unsigned char* src[kU];
  unsigned char* dst[kU];
  bool has[kU];
  // The bounds test also keeps a small copy's parameter reads above the
  // wait: without it the compiler hoists the wait above them.
  auto locate = [&](int u) {
    const int64_t idx = base + u * kT;
    has[u] = idx < job.total;
    if (has[u]) {
      int64_t from, to;
      core::copy_offsets<Index32>(job, idx, sizeof(V), from, to);
      src[u] = job.src + from;
      dst[u] = job.dst + to;
    }
  };
  // A small copy places its one vector before the wait (parameter arithmetic
  // only, so with PDL it overlaps the kernel before); a large copy places
  // each vector just before its load, which keeps fewer registers live.
  if constexpr (kSmall) locate(0);
  if constexpr (kPdl<kSmall>) wait_for_prior_kernels();  // cuda/launch.h: before any global memory access
  V value[kU];
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    if constexpr (!kSmall) locate(u);
    if (has[u])
      value[u] = load < V, !kSmall && CopyCudaPolicy::large_loads_evict_last > (reinterpret_cast<const V*>(src[u]));
  }
#pragma unroll
  for (int u = 0; u < kU; ++u)
    if (has[u]) *reinterpret_cast<V*>(dst[u]) = value[u];
}

template <typename V, bool kSmall>
cudaError_t launch_sized(const StridedCopyPlan& plan, const CopyCudaLaunch& l, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(l.grid_x), static_cast<unsigned>(l.grid_y));
  const dim3 block(kThreads<kSmall>);
  const bool one = !kSmall && plan.njobs == 1;
  const auto kernel =
      plan.index_bits == 32
          ? (one ? strided_copy_kernel<V, true, kSmall, !kSmall> : strided_copy_kernel<V, true, kSmall, false>)
          : (one ? strided_copy_kernel<V, false, kSmall, !kSmall> : strided_copy_kernel<V, false, kSmall, false>);
  if constexpr (kPdl<kSmall>) return launch_kernel(kernel, grid, block, stream, plan);
  return launch_kernel_without_pdl(kernel, grid, block, stream, plan);
}

template <typename V>
cudaError_t launch(const StridedCopyPlan& plan, const CopyCudaLaunch& l, cudaStream_t stream) {
  return l.small ? launch_sized<V, true>(plan, l, stream) : launch_sized<V, false>(plan, l, stream);
}

}  // namespace

cudaError_t strided_copy(const StridedCopyPlan& plan, cudaStream_t stream) {
  const CopyCudaLaunch l = core::plan_copy_cuda_launch(plan);
  if (l.grid_x == 0) return cudaSuccess;
  // grid.x is limited to 2^31 - 1 blocks: 3 jobs of 2^36 vectors (1 TiB each), far past any tensor.
  if (l.grid_x >= (int64_t{1} << 31) || l.threads != (l.small ? kThreads<true> : kThreads<false>))
    return cudaErrorInvalidConfiguration;
  switch (plan.vec_bytes) {
    case 16:
      return launch<uint4>(plan, l, stream);
    case 8:
      return launch<uint2>(plan, l, stream);
    case 4:
      return launch<uint32_t>(plan, l, stream);
    case 2:
      return launch<uint16_t>(plan, l, stream);
    default:
      return launch<uint8_t>(plan, l, stream);
  }
}

}  // namespace attnprep::cuda
