// What the .cu diagnostics in bench/ share: a CUDA error check that exits, and
// the per-call time of a launch replayed in a CUDA graph, timed as the op
// benchmarks time it (python/attnprep/_bench.py: `calls` launches captured
// as one graph, 200 replays, median of 5).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

// The launch floor the op benchmarks divide by: an empty kernel launched
// plainly (no PDL), like torch.cuda._sleep(0). The PDL floor is the library's
// own (cuda/launch_probe.h: launch_empty_library_kernel).
__global__ void empty_kernel() {}

#define CHECK_CUDA(x)                                                          \
  do {                                                                         \
    cudaError_t e = (x);                                                       \
    if (e != cudaSuccess) {                                                    \
      std::printf("%s failed: %s\n", #x, cudaGetErrorString(e));               \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

// `launch(stream)` enqueues one call; returns microseconds per call.
template <typename Launch>
double replay_us(Launch launch, int calls = 20, int replays = 200) {
  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CHECK_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < calls; ++i) launch(s);
  CHECK_CUDA(cudaStreamEndCapture(s, &g));
  CHECK_CUDA(cudaGraphInstantiate(&ge, g, 0));
  for (int i = 0; i < 10; ++i) CHECK_CUDA(cudaGraphLaunch(ge, s));
  CHECK_CUDA(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  std::vector<double> t;
  for (int rep = 0; rep < 5; ++rep) {
    CHECK_CUDA(cudaEventRecord(a, s));
    for (int i = 0; i < replays; ++i) CHECK_CUDA(cudaGraphLaunch(ge, s));
    CHECK_CUDA(cudaEventRecord(b, s));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1e3 / (replays * calls));
  }
  std::sort(t.begin(), t.end());
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  CHECK_CUDA(cudaGraphExecDestroy(ge));
  CHECK_CUDA(cudaGraphDestroy(g));
  CHECK_CUDA(cudaStreamDestroy(s));
  return t[2];
}
