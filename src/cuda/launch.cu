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

namespace {

// An attribute of the current device, asked once per device (devices past
// the table are asked each time); -1 when the runtime cannot say.
constexpr int kCachedDevices = 64;
int current_device_attribute(cudaDeviceAttr attr, std::atomic<int> (&cache)[kCachedDevices]) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  const bool cached = device >= 0 && device < kCachedDevices;
  if (cached) {
    const int known = cache[device].load(std::memory_order_relaxed);
    if (known) return known - 1;  // stored as value + 1: 0 means not asked yet
  }
  int value = 0;
  if (cudaDeviceGetAttribute(&value, attr, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  if (cached) cache[device].store(value + 1, std::memory_order_relaxed);
  return value;
}

}  // namespace

bool pdl_on_current_device() {
  static const bool by_environment = pdl_allowed_by_environment();
  const int mode = pdl_mode.load(std::memory_order_relaxed);
  if (mode == 0 || (mode < 0 && !by_environment)) return false;
  static std::atomic<int> major[kCachedDevices];
  return current_device_attribute(cudaDevAttrComputeCapabilityMajor, major) >= 9;
}

int multiprocessors_on_current_device() {
  static std::atomic<int> count[kCachedDevices];
  return current_device_attribute(cudaDevAttrMultiProcessorCount, count);
}

}  // namespace attnprep::cuda
