// How long one sin/cos of core::angle_sincos (a double rounded once; what the
// rope_base path computes per frequency before its block's barrier) holds a
// warp: one warp evaluates a chain of kCalls dependent calls (each angle
// nudged by the previous result, too little to change it), clock64 around
// the chain, cycles per call. Two sets of lanes: rotary angles of one
// position at 32 frequencies (the lanes in every quadrant) and 32 angles of
// one quadrant. A diagnostic for docs/performance-notes.md, not a kernel of
// the library.
//   nvcc -O3 -std=c++17 -arch=sm_90 --expt-relaxed-constexpr -Isrc bench/diagnostics/sincos_latency.cu -o /tmp/sc && /tmp/sc
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>

#include "core/angle_sincos.h"

namespace {

constexpr int kCalls = 64;
constexpr int kRuns = 5;

__global__ void chain(const float* angles, float* out, long long* cycles) {
  const int lane = static_cast<int>(threadIdx.x);
  float a = angles[lane], s = 0.f, c = 0.f, sum = 0.f;
  __syncwarp();
  const long long start = clock64();
  for (int i = 0; i < kCalls; ++i) {
    attnprep::core::angle_sincos(a + s * 1e-30f, &s, &c);
    sum += c;
  }
  const long long stop = clock64();
  out[lane] = sum + s;
  if (lane == 0) *cycles = stop - start;
}

double cycles_per_call(const float (&host)[32], float* angles, float* out, long long* cycles) {
  cudaMemcpy(angles, host, sizeof(host), cudaMemcpyHostToDevice);
  long long best = -1;
  for (int r = 0; r < kRuns; ++r) {  // the first run also loads the code
    chain<<<1, 32>>>(angles, out, cycles);
    long long c = 0;
    cudaMemcpy(&c, cycles, sizeof(c), cudaMemcpyDeviceToHost);
    if (best < 0 || c < best) best = c;
  }
  return static_cast<double>(best) / kCalls;
}

}  // namespace

int main() {
  float *angles = nullptr, *out = nullptr;
  long long* cycles = nullptr;
  if (cudaMalloc(&angles, 32 * sizeof(float)) != cudaSuccess || cudaMalloc(&out, 32 * sizeof(float)) != cudaSuccess ||
      cudaMalloc(&cycles, sizeof(long long)) != cudaSuccess) {
    std::printf("no CUDA device\n");
    return 77;
  }
  float rotary[32], one_quadrant[32];
  for (int i = 0; i < 32; ++i) {
    // position 100000 at frequencies 1 / 10000^(2i / 64), as a rope_base call computes them
    rotary[i] = 100000.0f * static_cast<float>(1.0 / std::pow(10000.0, 2.0 * i / 64.0));
    one_quadrant[i] = 0.5f + 1e-3f * static_cast<float>(i);
  }
  std::printf("angle_sincos, one warp, %d dependent calls, best of %d runs:\n", kCalls, kRuns);
  std::printf("  rotary angles (every quadrant): %.1f cycles a call\n", cycles_per_call(rotary, angles, out, cycles));
  std::printf("  one quadrant:                   %.1f cycles a call\n",
              cycles_per_call(one_quadrant, angles, out, cycles));
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
