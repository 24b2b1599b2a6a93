#include "cuda/strided_copy.h"

#include "cuda/launch.h"

#include <cstdint>

namespace attnprep::cuda {
namespace {

using core::CopyJobPlan;
using core::StridedCopyPlan;

// Block sizes and vectors per thread, overridable at build time for tuning
// runs (scripts/gpu_tune.sh); the defaults are measured (bench/RESULTS.md).
// A large copy runs 512 threads per block: with the kernel's 42-48 registers
// that is 2 blocks (1024 threads) per multiprocessor. Fewer accesses in
// flight measured faster than more: in one call, 2 x 512 (or 5 x 256 capped
// to 4 by shared memory) gained 0.3-0.7 points of copy bandwidth on the pack
// shapes over 5 x 256, while 6 or 8 x 256 (register limits), 2 x 384 and
// 1 x 1024 lost 0.5-3 points (bench/RESULTS.md, seventh session). Small
// copies keep 256 (128 and 512 measured slower at rows=65).
#ifndef ATTNPREP_COPY_THREADS
#define ATTNPREP_COPY_THREADS 512
#endif
#ifndef ATTNPREP_COPY_SMALL_THREADS
#define ATTNPREP_COPY_SMALL_THREADS 256
#endif
#ifndef ATTNPREP_COPY_UNROLL
#define ATTNPREP_COPY_UNROLL 4
#endif
// Vectors per thread, all loads issued before the stores: 4 for large copies
// (fewer blocks, more bytes in flight per thread); 1 when the copy is so small
// that 4 per thread would leave most multiprocessors idle (under 2^18
// vectors, 4 MiB of 16-byte ones), where spreading it wide shortens the one
// round trip (pack at rows=65: graph replay 2.33 -> 1.58 us, bench/RESULTS.md).
constexpr int kUnrollLarge = ATTNPREP_COPY_UNROLL;
constexpr int64_t kSmallCopyVectors = int64_t{1} << 18;
constexpr int threads_for(int unroll) { return unroll == 1 ? ATTNPREP_COPY_SMALL_THREADS : ATTNPREP_COPY_THREADS; }

// A large copy's blocks alternate between jobs along blockIdx.x (block b
// serves job b % njobs): the jobs of one op write interleaved parts of the
// same output rows, and running them side by side keeps DRAM writes to whole
// rows instead of one third of each (starting each job a third of the way
// further along measured 3.1-4.0 points of copy bandwidth slower at three
// pack shapes, bench/RESULTS.md, eighth session). A small copy's blocks, all
// on the GPU at once, take their job from blockIdx.y instead, so that its
// first parameter reads (each a cold miss at every launch) wait for no earlier
// one (graph replay of pack at rows=1: 0.87 -> 0.83 us, bench/RESULTS.md).
template <typename V, bool Index32, int kUnroll>
__global__ void __launch_bounds__(threads_for(kUnroll)) strided_copy_kernel(const __grid_constant__ StridedCopyPlan plan) {
  constexpr int kThreads = threads_for(kUnroll);
  // The next kernel on the stream may be scheduled from here: its blocks then
  // do their parameter reads while this one waits and copies (graph replay
  // of pack at rows=1 / 65: 0.84 / 1.13 -> 0.70 / 0.79 us, bench/RESULTS.md,
  // seventh session).
  let_next_kernel_start();
  const unsigned njobs = kUnroll == 1 ? 1u : static_cast<unsigned>(plan.njobs);
  const CopyJobPlan& job = plan.jobs[kUnroll == 1 ? blockIdx.y : blockIdx.x % njobs];
  const int64_t chunk = blockIdx.x / njobs;
  const int64_t base = chunk * (kThreads * kUnroll) + threadIdx.x;
  const unsigned char* src[kUnroll];
  unsigned char* dst[kUnroll];
  bool has[kUnroll];
  // The bounds branch also keeps the small path's parameter reads before the
  // wait: computed for every thread without it, ptxas placed the wait above
  // all of them (sm_90 SASS, bench/RESULTS.md, fifth session).
  auto locate = [&](int u) {
    const int64_t idx = base + u * kThreads;
    has[u] = idx < job.total;
    if (has[u]) {
      int64_t from, to;
      core::copy_offsets<Index32>(job, idx, sizeof(V), from, to);
      src[u] = job.src + from;
      dst[u] = job.dst + to;
    }
  };
  // A small copy (one vector per thread) places its vector, addresses and
  // all, before the wait: parameter arithmetic only, which with PDL overlaps
  // the kernel before this one, cold parameter-bank reads included (graph
  // replay of pack at rows=1: 0.94 -> 0.87 us). A large copy places each
  // vector just before its load: placing all four first measured 0.3-0.7%
  // slower (bench/RESULTS.md).
  if constexpr (kUnroll == 1) locate(0);
  wait_for_prior_kernels();  // cuda/launch.h: before any global memory access
  V value[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if constexpr (kUnroll > 1) locate(u);
    if (has[u]) value[u] = __ldg(reinterpret_cast<const V*>(src[u]));
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
    if (has[u]) *reinterpret_cast<V*>(dst[u]) = value[u];
}

template <typename V, int kUnroll>
cudaError_t launch_unrolled(const StridedCopyPlan& plan, cudaStream_t stream) {
  constexpr int64_t kThreads = threads_for(kUnroll), per_block = kThreads * kUnroll;
  const unsigned chunks = static_cast<unsigned>((plan.max_total + per_block - 1) / per_block);
  const unsigned njobs = static_cast<unsigned>(plan.njobs);
  const dim3 grid = kUnroll == 1 ? dim3(chunks, njobs) : dim3(chunks * njobs);
  if (plan.index_bits == 32) return launch_kernel(strided_copy_kernel<V, true, kUnroll>, grid, dim3(kThreads), stream, plan);
  return launch_kernel(strided_copy_kernel<V, false, kUnroll>, grid, dim3(kThreads), stream, plan);
}

template <typename V>
cudaError_t launch(const StridedCopyPlan& plan, cudaStream_t stream) {
  return plan.max_total * plan.njobs < kSmallCopyVectors ? launch_unrolled<V, 1>(plan, stream)
                                                         : launch_unrolled<V, kUnrollLarge>(plan, stream);
}

}  // namespace

cudaError_t strided_copy(const StridedCopyPlan& plan, cudaStream_t stream) {
  if (plan.max_total == 0 || plan.njobs == 0) return cudaSuccess;
  // grid.x is limited to 2^31 - 1 blocks: 3 jobs of 2^39 vectors, far past any tensor.
  switch (plan.vec_bytes) {
    case 16: return launch<uint4>(plan, stream);
    case 8: return launch<uint2>(plan, stream);
    case 4: return launch<uint32_t>(plan, stream);
    case 2: return launch<uint16_t>(plan, stream);
    default: return launch<uint8_t>(plan, stream);
  }
}

}  // namespace attnprep::cuda
