// Bindings of the copy-engine transport (attnprep/_peer.py): peer access, CUDA IPC buffers, 2-D async copies and
// stream memory operations on torch's stream, no kernel (capturable; never waiting for SMs). A peer's buffer is opened
// with the sending GPU current: opened in its own context, copies were staged by the driver (33 vs 389 GB/s).
#include <nanobind/stl/pair.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "bindings/cuda_launch.h"
#include "bindings/tensor_import.h"

namespace attnprep::bindings {
namespace {

constexpr const char* kNoCuda = "ulysses copy engine: this attnprep build has no CUDA backend";

#if ATTNPREP_WITH_CUDA
[[noreturn]] void fail(const char* what, cudaError_t err) {
  cudaGetLastError();
  throw std::runtime_error(std::string("ulysses copy engine: ") + what + ": " + cudaGetErrorString(err));
}

// A driver function through the runtime's entry-point query (the extension
// links only the static runtime, not libcuda), its CUDA 12.0 signature.
template <typename Fn>
Fn driver_function(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
  const cudaError_t err = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found);
#else
  const cudaError_t err = cudaGetDriverEntryPoint(name, &p, cudaEnableDefault, &found);
#endif
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr)
    throw std::runtime_error(std::string("ulysses copy engine: the driver has no ") + name);
  return reinterpret_cast<Fn>(p);
}

// cuMemGetAddressRange, cuStreamWaitValue32, cuStreamWriteValue32 (CUresult is an int)
using AddressRangeFn = int (*)(unsigned long long* base, size_t* size, unsigned long long ptr);
using StreamValueFn = int (*)(cudaStream_t stream, unsigned long long addr, unsigned int value, unsigned int flags);
constexpr unsigned int kWaitEqual = 0x1;     // CU_STREAM_WAIT_VALUE_EQ
constexpr unsigned int kWriteDefault = 0x0;  // CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence before the write

// The IPC handle of the allocation holding `addr` and addr's offset in it.
std::pair<nb::bytes, int64_t> ipc_export(uintptr_t addr, int device) {
  static const auto address_range = driver_function<AddressRangeFn>("cuMemGetAddressRange");
  CudaDeviceGuard guard(device);
  unsigned long long base = 0;
  size_t size = 0;
  if (address_range(&base, &size, addr) != 0) throw std::runtime_error("ulysses copy engine: not a device address");
  cudaIpcMemHandle_t handle;
  const cudaError_t err = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base));
  if (err != cudaSuccess) fail("cudaIpcGetMemHandle", err);
  return {nb::bytes(handle.reserved, sizeof(handle.reserved)), static_cast<int64_t>(addr - base)};
}

// Another process's allocation mapped into `device`'s context: its base address here.
uintptr_t ipc_open(nb::bytes exported, int device) {
  cudaIpcMemHandle_t handle;
  if (exported.size() != sizeof(handle.reserved)) throw std::runtime_error("ulysses copy engine: bad IPC handle");
  std::memcpy(handle.reserved, exported.c_str(), sizeof(handle.reserved));
  CudaDeviceGuard guard(device);
  void* base = nullptr;
  const cudaError_t err = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) fail("cudaIpcOpenMemHandle", err);
  return reinterpret_cast<uintptr_t>(base);
}

// Whether `device` can read and write `peer`'s memory; enables it when it can.
bool peer_access(int device, int peer) {
  if (device == peer) return true;
  int can = 0;
  if (cudaDeviceCanAccessPeer(&can, device, peer) != cudaSuccess || !can) {
    cudaGetLastError();
    return false;
  }
  CudaDeviceGuard guard(device);
  const cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled)
    cudaGetLastError();  // not an error here
  else if (err != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return true;
}

// `height` rows of `width` bytes, src rows `spitch` bytes apart, dst rows `dpitch`.
void peer_copy_2d(uintptr_t dst, int64_t dpitch, uintptr_t src, int64_t spitch, int64_t width, int64_t height,
                  int device) {
  if (width <= 0 || height <= 0) return;
  const core::Device d{core::DeviceType::CUDA, device};
  ATTNPREP_RUN_CUDA(
      "ulysses copy engine", d, stream,
      cudaMemcpy2DAsync(reinterpret_cast<void*>(dst), static_cast<size_t>(dpitch), reinterpret_cast<const void*>(src),
                        static_cast<size_t>(spitch), static_cast<size_t>(width), static_cast<size_t>(height),
                        cudaMemcpyDefault, stream));
}

// A stream memory operation (`op`: cuStreamWaitValue32 or cuStreamWriteValue32) on torch's current stream.
void stream_value(StreamValueFn op, const char* name, uintptr_t addr, unsigned int value, unsigned int flags,
                  int device) {
  const core::Device d{core::DeviceType::CUDA, device};
  CudaDeviceGuard guard(device);
  const int err = op(static_cast<cudaStream_t>(current_stream(d)), addr, value, flags);
  if (err != 0)
    throw std::runtime_error(std::string("ulysses copy engine: ") + name + " failed (CUresult " + std::to_string(err) +
                             ")");
}

void stream_wait(uintptr_t addr, unsigned int value, int device) {
  static const auto op = driver_function<StreamValueFn>("cuStreamWaitValue32");
  stream_value(op, "cuStreamWaitValue32", addr, value, kWaitEqual, device);
}

void stream_write(uintptr_t addr, unsigned int value, int device) {
  static const auto op = driver_function<StreamValueFn>("cuStreamWriteValue32");
  stream_value(op, "cuStreamWriteValue32", addr, value, kWriteDefault, device);
}
#else
std::pair<nb::bytes, int64_t> ipc_export(uintptr_t, int) { throw std::runtime_error(kNoCuda); }
uintptr_t ipc_open(nb::bytes, int) { throw std::runtime_error(kNoCuda); }
bool peer_access(int, int) { return false; }
void peer_copy_2d(uintptr_t, int64_t, uintptr_t, int64_t, int64_t, int64_t, int) { throw std::runtime_error(kNoCuda); }
void stream_wait(uintptr_t, unsigned int, int) { throw std::runtime_error(kNoCuda); }
void stream_write(uintptr_t, unsigned int, int) { throw std::runtime_error(kNoCuda); }
#endif

}  // namespace

void init_peer(nb::module_& m) {
  m.def("_peer_access", &peer_access, nb::arg("device"), nb::arg("peer"),
        "Whether device can access peer's memory (enabled when it can).");
  m.def("_ipc_export", &ipc_export, nb::arg("addr"), nb::arg("device"),
        "(IPC handle, offset) of the device allocation holding addr.");
  m.def("_ipc_open", &ipc_open, nb::arg("handle"), nb::arg("device"),
        "Base address, in device's context, of another process's allocation (its IPC handle).");
  m.def("_peer_copy_2d", &peer_copy_2d, nb::arg("dst"), nb::arg("dpitch"), nb::arg("src"), nb::arg("spitch"),
        nb::arg("width"), nb::arg("height"), nb::arg("device"),
        "cudaMemcpy2DAsync on torch's current stream of device (bytes and pitches in bytes).");
  m.def("_stream_wait", &stream_wait, nb::arg("addr"), nb::arg("value"), nb::arg("device"),
        "torch's current stream of device waits until the 32-bit word at addr equals value.");
  m.def("_stream_write", &stream_write, nb::arg("addr"), nb::arg("value"), nb::arg("device"),
        "torch's current stream of device writes value to the 32-bit word at addr (after a memory fence).");
}

}  // namespace attnprep::bindings
