// Launch with programmatic dependent launch (sm_90+): every kernel calls wait_for_prior_kernels() before its first
// global access (only parameter arithmetic before it) and let_next_kernel_start() somewhere, so ordering is as
// without PDL. ATTNPREP_PDL=0 turns it off (read once); set_pdl_mode() overrides it for the process.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace attnprep::cuda {

// Lets the next kernel on the stream be scheduled now (it still waits for this whole kernel in its own
// wait_for_prior_kernels()); takes effect once every block has called it or exited. Placement is a speed choice.
__device__ __forceinline__ void let_next_kernel_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Returns once every earlier kernel on the stream has finished and its
// writes are visible.
__device__ __forceinline__ void wait_for_prior_kernels() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Whether launches on the current device use PDL: the mode, and the device's
// compute capability (cached per device).
bool pdl_on_current_device();
// -1: as the environment says (the default), 0: off, 1: on where supported.
void set_pdl_mode(int mode);
// The current device's multiprocessor count (cached per device); -1 when the
// runtime cannot say.
int multiprocessors_on_current_device();

namespace detail {
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream, bool pdl,
                   Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attrs[1];
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = 1;
  if (pdl) {
    config.attrs = attrs;
    config.numAttrs = 1;
  }
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err;
}
}  // namespace detail

// Launches `kernel` (with PDL where on) and returns the launch status; a
// failed launch leaves no pending error behind for the next CUDA call on
// this thread to trip over.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, Args&&... args) {
  return detail::launch(kernel, grid, block, 0, stream, pdl_on_current_device(), std::forward<Args>(args)...);
}

// The same with `shared_bytes` of dynamic shared memory per block (at most
// 48 KB: no opt-in attribute is set).
template <typename... Params, typename... Args>
cudaError_t launch_kernel_shared(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                                 cudaStream_t stream, Args&&... args) {
  return detail::launch(kernel, grid, block, shared_bytes, stream, pdl_on_current_device(),
                        std::forward<Args>(args)...);
}

// The same without PDL, for a kernel that neither waits nor lets the next
// start (it is ordered after the kernel before it, as any plain launch):
// one whose many short blocks would each pay for the two instructions.
template <typename... Params, typename... Args>
cudaError_t launch_kernel_without_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                                      Args&&... args) {
  return detail::launch(kernel, grid, block, 0, stream, false, std::forward<Args>(args)...);
}

}  // namespace attnprep::cuda
