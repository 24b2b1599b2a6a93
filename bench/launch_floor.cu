// Launch floors under CUDA-graph replay: the per-call time of tiny kernels
// when 20 launches are replayed as one graph, timed like the op benchmarks
// (python/attnprep/_bench.py: 200 replays, median of 5). It says what part of
// an op's small-shape replay time any kernel pays: the launch itself, the
// kernel's parameter block, one round trip to memory, and a load whose address
// comes from another load (positions/slots -> pool rows); and the same kernels
// launched with programmatic dependent launch (PDL) through attnprep's own
// launcher and wait (src/cuda/launch.h), the floor for attnprep's small calls.
//   nvcc -O3 -std=c++17 -arch=sm_90 -Isrc bench/launch_floor.cu src/cuda/launch.cu -o /tmp/launch_floor && /tmp/launch_floor
#include <cuda_runtime.h>

#include "cuda/launch.h"
#include "graph_replay.h"

#include <cstdio>

template <int P>
struct Blob {
  unsigned char b[P];
};

__global__ void empty_kernel() {}

// Reads one byte of its parameter block, so the block is really passed.
template <int P>
__global__ void param_kernel(const __grid_constant__ Blob<P> blob, int* sink) {
  if (blob.b[threadIdx.x % P] == 0xff) *sink = 1;
}

// 128 threads move one 16-byte vector each: the smallest data-moving op.
template <int P>
__global__ void copy_kernel(const __grid_constant__ Blob<P> blob, const uint4* src, uint4* dst) {
  uint4 v = src[threadIdx.x];
  v.x ^= blob.b[0];
  dst[threadIdx.x] = v;
}

// The same, to a row chosen by an index read from memory first.
__global__ void indexed_copy_kernel(const int* index, const uint4* src, uint4* dst) {
  const int row = index[0];
  dst[row * 128 + threadIdx.x] = src[threadIdx.x];
}

using attnprep::cuda::let_next_kernel_start;
using attnprep::cuda::wait_for_prior_kernels;

// The wait, then the next kernel let in (the order attnprep's rope kernel uses).
__device__ __forceinline__ void wait_then_let_next() {
  wait_for_prior_kernels();
  let_next_kernel_start();
}

// Launches as attnprep launches (PDL on compute capability 9.0+).
template <typename... Params, typename... Args>
void launch_pdl_grid(void (*kernel)(Params...), int blocks, int threads, cudaStream_t s, Args... args) {
  CHECK_CUDA(attnprep::cuda::launch_kernel(kernel, dim3(blocks), dim3(threads), s, args...));
}

__global__ void pdl_empty_kernel() { wait_then_let_next(); }

__global__ void pdl_copy_kernel(const uint4* src, uint4* dst) {
  wait_then_let_next();
  dst[threadIdx.x] = src[threadIdx.x];
}

// The same with a parameter block of P bytes, one byte of it read before the wait.
template <int P>
__global__ void pdl_param_copy_kernel(const __grid_constant__ Blob<P> blob, const uint4* src, uint4* dst) {
  const unsigned char b = blob.b[threadIdx.x % P];
  wait_then_let_next();
  uint4 v = src[threadIdx.x];
  v.x ^= b;
  dst[threadIdx.x] = v;
}

// The same, letting the next kernel on the stream be scheduled at entry
// rather than after the wait (griddepcontrol.launch_dependents first).
template <int P>
__global__ void pdl_early_param_copy_kernel(const __grid_constant__ Blob<P> blob, const uint4* src, uint4* dst) {
  let_next_kernel_start();
  const unsigned char b = blob.b[threadIdx.x % P];
  wait_for_prior_kernels();
  uint4 v = src[threadIdx.x];
  v.x ^= b;
  dst[threadIdx.x] = v;
}

// One load, then a second load whose address depends on it, then the store:
// rope's chain (position -> cos/sin -> rotated row), without the arithmetic.
__global__ void pdl_indexed_copy_kernel(const int* index, const uint4* src, uint4* dst) {
  wait_then_let_next();
  const int row = index[0];
  dst[threadIdx.x] = src[row * 128 + threadIdx.x];
}

template <typename... Params, typename... Args>
void launch_pdl(void (*kernel)(Params...), int threads, cudaStream_t s, Args... args) {
  launch_pdl_grid(kernel, 1, threads, s, args...);
}

int main() {
  int* sink;
  int* index;
  uint4 *src, *dst;
  CHECK_CUDA(cudaMalloc(&sink, 4));
  CHECK_CUDA(cudaMalloc(&index, 4));
  CHECK_CUDA(cudaMemset(index, 0, 4));
  CHECK_CUDA(cudaMalloc(&src, 128 * 16));
  CHECK_CUDA(cudaMalloc(&dst, 128 * 16));
  const Blob<640> b640{};
  const Blob<1280> b1280{};
  const Blob<4000> b4000{};
  const Blob<16> b16{};
  std::printf("| kernel (graph replay, 20 per graph) | us per call |\n|---|---|\n");
  std::printf("| empty, no parameters | %.3f |\n", replay_us([&](cudaStream_t s) { empty_kernel<<<1, 32, 0, s>>>(); }));
  std::printf("| empty, 16 B of parameters | %.3f |\n",
              replay_us([&](cudaStream_t s) { param_kernel<16><<<1, 32, 0, s>>>(b16, sink); }));
  std::printf("| empty, 640 B of parameters | %.3f |\n",
              replay_us([&](cudaStream_t s) { param_kernel<640><<<1, 32, 0, s>>>(b640, sink); }));
  std::printf("| empty, 1280 B of parameters | %.3f |\n",
              replay_us([&](cudaStream_t s) { param_kernel<1280><<<1, 32, 0, s>>>(b1280, sink); }));
  std::printf("| empty, 4000 B of parameters | %.3f |\n",
              replay_us([&](cudaStream_t s) { param_kernel<4000><<<1, 32, 0, s>>>(b4000, sink); }));
  std::printf("| copy 128 x 16 B, 16 B of parameters | %.3f |\n",
              replay_us([&](cudaStream_t s) { copy_kernel<16><<<1, 128, 0, s>>>(b16, src, dst); }));
  std::printf("| copy 128 x 16 B, 1280 B of parameters | %.3f |\n",
              replay_us([&](cudaStream_t s) { copy_kernel<1280><<<1, 128, 0, s>>>(b1280, src, dst); }));
  std::printf("| copy 128 x 16 B to a row read from memory | %.3f |\n",
              replay_us([&](cudaStream_t s) { indexed_copy_kernel<<<1, 128, 0, s>>>(index, src, dst); }));
  std::printf("| PDL: empty, waiting for the kernel before | %.3f |\n",
              replay_us([&](cudaStream_t s) { launch_pdl(pdl_empty_kernel, 32, s); }));
  std::printf("| PDL: copy 128 x 16 B after the wait | %.3f |\n",
              replay_us([&](cudaStream_t s) { launch_pdl(pdl_copy_kernel, 128, s, (const uint4*)src, dst); }));
  std::printf("| PDL: copy 128 x 16 B from a row read from memory | %.3f |\n",
              replay_us([&](cudaStream_t s) { launch_pdl(pdl_indexed_copy_kernel, 128, s, (const int*)index, (const uint4*)src, dst); }));
  std::printf("| PDL: copy 128 x 16 B after the wait, 640 B of parameters | %.3f |\n",
              replay_us([&](cudaStream_t s) { launch_pdl(pdl_param_copy_kernel<640>, 128, s, b640, (const uint4*)src, dst); }));
  std::printf("| PDL: copy 128 x 16 B after the wait, 1280 B of parameters | %.3f |\n",
              replay_us([&](cudaStream_t s) { launch_pdl(pdl_param_copy_kernel<1280>, 128, s, b1280, (const uint4*)src, dst); }));
  std::printf("| PDL: 3 blocks copy 128 x 16 B each, 640 B of parameters | %.3f |\n",
              replay_us([&](cudaStream_t s) { launch_pdl_grid(pdl_param_copy_kernel<640>, 3, 128, s, b640, (const uint4*)src, dst); }));
  std::printf("| PDL, next kernel scheduled at entry: copy 128 x 16 B after the wait, 640 B of parameters | %.3f |\n",
              replay_us([&](cudaStream_t s) { launch_pdl(pdl_early_param_copy_kernel<640>, 128, s, b640, (const uint4*)src, dst); }));
  std::printf("| PDL, next kernel scheduled at entry: 3 blocks copy 128 x 16 B each, 640 B of parameters | %.3f |\n",
              replay_us([&](cudaStream_t s) { launch_pdl_grid(pdl_early_param_copy_kernel<640>, 3, 128, s, b640, (const uint4*)src, dst); }));
  return 0;
}
