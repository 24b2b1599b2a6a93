// Running a CUDA launcher from a binding: the tensors' device made current
// for the launch (and the caller's restored), torch's current stream, and a
// failed launch turned into a RuntimeError that names the op.
#pragma once

#include <stdexcept>
#include <string>

#include "bindings/tensor_import.h"
#include "core/tensor.h"

#if ATTNPREP_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace attnprep::bindings {

#if ATTNPREP_WITH_CUDA
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) cudaSetDevice(device);
  }
  ~CudaDeviceGuard() {
    int now = -1;
    if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// `launch(stream)` returns a cudaError_t.
template <typename Launch>
void run_cuda(const char* op, const core::Device& device, Launch&& launch) {
  CudaDeviceGuard guard(device.index);
  auto stream = static_cast<cudaStream_t>(current_stream(device));
  const cudaError_t err = launch(stream);
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(op) + ": CUDA kernel launch failed: " + cudaGetErrorString(err));
}
#define ATTNPREP_RUN_CUDA(op, device, stream, call) \
  ::attnprep::bindings::run_cuda(op, device, [&](cudaStream_t stream) { return call; })
#else
#define ATTNPREP_RUN_CUDA(op, device, stream, call) \
  throw std::runtime_error(std::string(op) + ": this attnprep build has no CUDA backend")
#endif

}  // namespace attnprep::bindings
