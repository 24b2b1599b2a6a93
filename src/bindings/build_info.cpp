// What this binary was built with, for attnprep.build_info().
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "bindings/cuda_launch.h"
#include "bindings/tensor_import.h"

#if ATTNPREP_WITH_CUDA
#include "cuda/launch.h"
#include "cuda/launch_probe.h"
#endif

#if ATTNPREP_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace attnprep::bindings {

void init_build_info(nb::module_& m) {
  m.def("_build_info", []() {
    nb::dict info;
    info["version"] = ATTNPREP_VERSION;
#if ATTNPREP_WITH_CUDA
    info["cuda"] = true;
    info["cuda_version"] = std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
    info["cuda_architectures"] = ATTNPREP_CUDA_ARCHITECTURES;
#else
    info["cuda"] = false;
    info["cuda_version"] = nb::none();
    info["cuda_architectures"] = "";
#endif
    info["metal"] = static_cast<bool>(ATTNPREP_WITH_METAL);
    info["dlpack_path"] = dlpack_path();
    return info;
  });
#if ATTNPREP_WITH_CUDA
  // Benchmark helper: host us per bare launch on torch's current stream of `device`.
  m.def("_empty_launch_us", [](int device, int launches) {
    core::Device d{core::DeviceType::CUDA, device};
    double us = -1;
    run_cuda("_empty_launch_us", d, [&](cudaStream_t stream) {
      us = cuda::empty_launch_us(launches, stream);
      return cudaGetLastError();
    });
    return us;
  });
  // Benchmark/test helpers: programmatic dependent launch (src/cuda/launch.h).
  // mode -1: as ATTNPREP_PDL says, 0: off, 1: on where the device has it.
  m.def("_set_pdl_mode", [](int mode) { cuda::set_pdl_mode(mode); });
  m.def("_pdl_on", [](int device) {
    core::Device d{core::DeviceType::CUDA, device};
    bool on = false;
    run_cuda("_pdl_on", d, [&](cudaStream_t) {
      on = cuda::pdl_on_current_device();
      return cudaSuccess;
    });
    return on;
  });
  m.def("_launch_empty", [](int device) {
    core::Device d{core::DeviceType::CUDA, device};
    run_cuda("_launch_empty", d, [&](cudaStream_t stream) { return cuda::launch_empty_library_kernel(stream); });
  });
#endif
}

}  // namespace attnprep::bindings
