// Internal bindings of the Ulysses layer's copy-engine transport
// (docs/contract.md, attnprep/_peer.py): peer access between two GPUs of one
// process, and an asynchronous copy between device addresses (a peer's
// buffer opened through CUDA IPC included) on torch's current stream. The
// copy is a cudaMemcpyAsync: the GPU's copy engines move the bytes, no
// kernel runs, and it is captured into CUDA graphs as a memcpy node.
#include <cstdint>
#include <stdexcept>
#include <string>

#include "bindings/cuda_launch.h"
#include "bindings/tensor_import.h"

namespace attnprep::bindings {
namespace {

#if ATTNPREP_WITH_CUDA
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
  if (err == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();  // not an error here
  else if (err != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return true;
}

void peer_copy(uintptr_t dst, uintptr_t src, int64_t nbytes, int device) {
  if (nbytes <= 0) return;
  const core::Device d{core::DeviceType::CUDA, device};
  ATTNPREP_RUN_CUDA("ulysses copy engine", d, stream,
                    cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                                    static_cast<size_t>(nbytes), cudaMemcpyDefault, stream));
}
#else
bool peer_access(int, int) { return false; }
void peer_copy(uintptr_t, uintptr_t, int64_t, int) {
  throw std::runtime_error("ulysses copy engine: this attnprep build has no CUDA backend");
}
#endif

}  // namespace

void init_peer(nb::module_& m) {
  m.def("_peer_access", &peer_access, nb::arg("device"), nb::arg("peer"),
        "Whether device can access peer's memory (enabled when it can).");
  m.def("_peer_copy", &peer_copy, nb::arg("dst"), nb::arg("src"), nb::arg("nbytes"), nb::arg("device"),
        "cudaMemcpyAsync of nbytes from src to dst on torch's current stream of device.");
}

}  // namespace attnprep::bindings
