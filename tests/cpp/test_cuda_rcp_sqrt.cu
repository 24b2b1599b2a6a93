// rcp_sqrt_rn (the QK norm's 1 / sqrt) against __frcp_rn(__fsqrt_rn(v)), the
// correctly rounded root and reciprocal, for every one of the 2^32 floats on
// the GPU at hand: its common path is the hardware's approximations
// corrected, so each GPU it runs on is checked whole. Exits 77 (skipped)
// without a device.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "check.h"
#include "cuda/rcp_sqrt.cuh"
#include "gpu_main.h"

namespace {

struct Mismatches {
  unsigned long long count;
  unsigned int first;  // the smallest mismatching bit pattern
};

// NaN inputs must give NaN; every other input the same bits.
__global__ void compare_all(Mismatches* m) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t b = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; b < (uint64_t{1} << 32); b += stride) {
    const float v = __uint_as_float(static_cast<unsigned int>(b));
    const float got = attnprep::cuda::rcp_sqrt_rn(v), want = __frcp_rn(__fsqrt_rn(v));
    const bool same = __float_as_uint(got) == __float_as_uint(want) || (got != got && want != want);
    if (!same) {
      atomicAdd(&m->count, 1ull);
      atomicMin(&m->first, static_cast<unsigned int>(b));
    }
  }
}

__global__ void one(float v, float* out) { *out = attnprep::cuda::rcp_sqrt_rn(v); }

float on_gpu(float v) {
  float* d = nullptr;
  float out = 0.f;
  cudaMalloc(&d, sizeof(float));
  one<<<1, 1>>>(v, d);
  cudaMemcpy(&out, d, sizeof(float), cudaMemcpyDeviceToHost);
  cudaFree(d);
  return out;
}

}  // namespace

TEST_CASE("GPU rcp_sqrt_rn: every float as __frcp_rn(__fsqrt_rn(v))") {
  Mismatches* m = nullptr;
  CHECK_EQ(cudaMallocManaged(&m, sizeof(Mismatches)), cudaSuccess);
  m->count = 0;
  m->first = 0xffffffffu;
  compare_all<<<1024, 256>>>(m);
  CHECK_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (m->count != 0) std::fprintf(stderr, "%llu mismatches, first bits 0x%08x\n", m->count, m->first);
  CHECK_EQ(m->count, 0ull);
  cudaFree(m);
}

// The CPU reference's expression, at the common path's edges and beyond it.
TEST_CASE("GPU rcp_sqrt_rn: as the CPU reference's 1.0f / std::sqrt(v)") {
  const unsigned int bits[] = {
      0x3f800000u, 0x40000000u, 0x40400000u, 0x358637bdu,  // 1, 2, 3, float32(1e-6)
      0x0d000000u, 0x0cffffffu,                            // 2^-101 (the common path's first) and below
      0x7f7fffffu, 0x00800000u, 0x007fffffu, 0x00000001u,  // FLT_MAX, smallest normal, denormals
      0x00000000u, 0x7f800000u, 0xbf800000u,               // 0, inf, -1
  };
  for (unsigned int b : bits) {
    float v;
    std::memcpy(&v, &b, sizeof v);
    const float want = 1.0f / std::sqrt(v), got = on_gpu(v);
    unsigned int gb, wb;
    std::memcpy(&gb, &got, sizeof gb);
    std::memcpy(&wb, &want, sizeof wb);
    if (gb != wb && !(got != got && want != want)) std::fprintf(stderr, "v bits 0x%08x: 0x%08x != 0x%08x\n", b, gb, wb);
    CHECK(gb == wb || (got != got && want != want));
  }
}

int main() { return test::run_all_on_gpu(); }
