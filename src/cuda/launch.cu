#include "cuda/launch.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace attnprep::cuda {
namespace {

bool pdl_allowed_by_environment() {
  const char* v = std::getenv("ATTNPREP_PDL");
  return !(v && std::strcmp(v, "0") == 0);
}

std::atomic<int> pdl_mode{-1};

}  // namespace

void set_pdl_mode(int mode) { pdl_mode.store(mode < 0 ? -1 : (mode ? 1 : 0), std::memory_order_relaxed); }

bool pdl_on_current_device() {
  static const bool by_environment = pdl_allowed_by_environment();
  const int mode = pdl_mode.load(std::memory_order_relaxed);
  if (mode == 0 || (mode < 0 && !by_environment)) return false;
  // 0: not asked yet, 1: no, 2: yes. Devices past the table are asked each time.
  constexpr int kCached = 64;
  static std::atomic<signed char> cache[kCached];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (device >= 0 && device < kCached) {
    const signed char known = cache[device].load(std::memory_order_relaxed);
    if (known) return known == 2;
  }
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  const bool yes = major >= 9;
  if (device >= 0 && device < kCached) cache[device].store(yes ? 2 : 1, std::memory_order_relaxed);
  return yes;
}

}  // namespace attnprep::cuda
