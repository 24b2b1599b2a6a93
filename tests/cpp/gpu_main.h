// The GPU tests' main: their cases, or exit 77 (ctest's "skipped") where no
// CUDA device is present.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>

#include "check.h"

namespace test {

inline int run_all_on_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  return run_all();
}

}  // namespace test
