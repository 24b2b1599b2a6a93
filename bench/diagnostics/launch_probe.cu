// An empty kernel, launched from this library's own runtime, to measure the
// host cost of a bare launch on the machine at hand (the floor under every
// op's per-call overhead). Used by the benchmarks only.
#include <chrono>

#include "launch_probe.h"

#include "cuda/launch.h"

namespace attnprep::cuda {
namespace {
__global__ void empty_kernel() {}
// The same, launched the way the library's kernels are (cuda/launch.h), and,
// like them, waiting for the kernel before it: the floor under their
// CUDA-graph replay time.
__global__ void empty_library_kernel() {
  let_next_kernel_start();
  wait_for_prior_kernels();
}
}  // namespace

cudaError_t launch_empty_library_kernel(cudaStream_t stream) {
  return launch_kernel(empty_library_kernel, dim3(1), dim3(32), stream);
}

double empty_launch_us(int launches, cudaStream_t stream) {
  empty_kernel<<<1, 32, 0, stream>>>();
  cudaStreamSynchronize(stream);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < launches; ++i) empty_kernel<<<1, 32, 0, stream>>>();
  const auto t1 = std::chrono::steady_clock::now();
  cudaStreamSynchronize(stream);
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / launches;
}

}  // namespace attnprep::cuda
