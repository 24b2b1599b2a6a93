// Launch floors under CUDA-graph replay: the per-call time of tiny kernels
// when 20 launches are replayed as one graph, timed like the op benchmarks
// (attnprep.testing.bench: 200 replays, median of 5). It says what part of
// an op's small-shape replay time any kernel pays: the launch itself, the
// kernel's parameter block, one round trip to memory, and a load whose address
// comes from another load (positions/slots -> pool rows); and the same kernels
// launched with programmatic dependent launch (PDL) through attnprep's own
// launcher and wait (src/cuda/launch.h), the floor for attnprep's small calls.
// Its second table copies a small pack's bytes contiguously, with the
// library's copy engine and with plain kernels: what moving those bytes costs
// whatever their layout. Built with -DATTNPREP_BUILD_DIAGNOSTICS=ON (target launch_floor), or:
//   nvcc -O3 -std=c++17 -arch=sm_90 --expt-relaxed-constexpr -Isrc -Ibench/diagnostics bench/diagnostics/launch_floor.cu src/cuda/launch.cu \
//     bench/diagnostics/launch_probe.cu src/cuda/strided_copy.cu src/core/strided_copy.cpp -o /tmp/launch_floor && /tmp/launch_floor
#include <cuda_runtime.h>

#include "cuda/launch.h"
#include "launch_probe.h"
#include "cuda/strided_copy.h"
#include "graph_replay.h"

#include <cstdio>

template <int P>
struct Blob {
  unsigned char b[P];
};

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

// A plain contiguous copy of n 16-byte vectors, U per thread, launched as
// attnprep launches (PDL, next kernel let in at entry) and waiting before its
// loads. Unlike the copy engine, it does not get its parameter reads above the
// wait: in its sm_90 SASS ptxas moves them (and the addresses) below
// `griddepcontrol.wait`, whether the parameters are read directly or through
// an index, so each call pays a cold parameter read after the wait. The rows
// beside it that use the library's engine (`engine_row`) are the floor.
template <int U>
__global__ void pdl_contiguous_copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, int n) {
  let_next_kernel_start();
  const int base = blockIdx.x * blockDim.x * U + threadIdx.x;
  wait_for_prior_kernels();
  uint4 v[U];
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (base + u * static_cast<int>(blockDim.x) < n) v[u] = __ldg(src + base + u * blockDim.x);
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (base + u * static_cast<int>(blockDim.x) < n) dst[base + u * blockDim.x] = v[u];
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
  // pack's bytes at (rows, 8, 128, world 8) bf16: q, k, v of rows x 2 KiB each.
  uint4 *big_src, *big_dst;
  const int kMaxVectors = 129 * 3 * 128;
  CHECK_CUDA(cudaMalloc(&big_src, kMaxVectors * 16));
  CHECK_CUDA(cudaMalloc(&big_dst, kMaxVectors * 16));
  CHECK_CUDA(cudaMemset(big_src, 0, kMaxVectors * 16));
  std::printf("\n| contiguous copy of a pack's bytes, (rows, 8, 128, world 8) bf16 | blocks | us per call |\n|---|---|---|\n");
  std::printf("| empty kernel (no PDL) | 1 | %.3f |\n", replay_us([&](cudaStream_t s) { empty_kernel<<<1, 32, 0, s>>>(); }));
  std::printf("| PDL: empty (the library's, as in the op benchmarks) | 1 | %.3f |\n",
              replay_us([&](cudaStream_t s) { CHECK_CUDA(attnprep::cuda::launch_empty_library_kernel(s)); }));
  auto row = [&](int rows, auto kernel, int unroll, int threads, bool pdl) {
    const int n = rows * 3 * 128, blocks = (n + threads * unroll - 1) / (threads * unroll);
    const double us = replay_us([&](cudaStream_t s) {
      if (pdl) launch_pdl_grid(kernel, blocks, threads, s, (const uint4*)big_src, big_dst, n);
      else kernel<<<blocks, threads, 0, s>>>(big_src, big_dst, n);
    });
    std::printf("| rows=%d (%d KB moved), %d threads x %d vectors%s | %d | %.3f |\n", rows, 2 * n * 16 / 1000, threads,
                unroll, pdl ? ", PDL" : ", no PDL", blocks, us);
  };
  // The library's copy engine on the same bytes laid out contiguously: one
  // job, or three (q, k, v each to its own contiguous third), beside pack's
  // own layout (bench/sweep_pack_rows.py).
  auto engine_row = [&](int rows, int njobs) {
    const int64_t bytes = int64_t{rows} * 3 * 128 * 16 / njobs;
    attnprep::core::CopyJob jobs[3];
    for (int j = 0; j < njobs; ++j) {
      jobs[j].src = reinterpret_cast<const unsigned char*>(big_src) + j * bytes;
      jobs[j].dst = reinterpret_cast<unsigned char*>(big_dst) + j * bytes;
      jobs[j].row_bytes = bytes;
      jobs[j].src_elem_stride = 2;
      jobs[j].itemsize = 2;
    }
    const attnprep::core::StridedCopyPlan plan = attnprep::core::plan_strided_copy(jobs, njobs);
    const double us = replay_us([&](cudaStream_t s) { CHECK_CUDA(attnprep::cuda::strided_copy(plan, s)); });
    // blocks: what the engine launches for a copy this small (256 threads, one vector each, per job)
    std::printf("| rows=%d, the library's copy engine, %d contiguous job%s | %lld | %.3f |\n", rows, njobs,
                njobs > 1 ? "s" : "", static_cast<long long>((bytes / 16 + 255) / 256) * njobs, us);
  };
  for (int rows : {1, 65}) {
    engine_row(rows, 1);
    engine_row(rows, 3);
    row(rows, pdl_contiguous_copy_kernel<1>, 1, 256, false);
    row(rows, pdl_contiguous_copy_kernel<1>, 1, 128, true);
    row(rows, pdl_contiguous_copy_kernel<1>, 1, 256, true);
    row(rows, pdl_contiguous_copy_kernel<1>, 1, 512, true);
    row(rows, pdl_contiguous_copy_kernel<2>, 2, 256, true);
    row(rows, pdl_contiguous_copy_kernel<4>, 4, 256, true);
    row(rows, pdl_contiguous_copy_kernel<4>, 4, 128, true);
    row(rows, pdl_contiguous_copy_kernel<8>, 8, 128, true);
  }
  return 0;
}
