// What this binary was built with, for attnprep.build_info().
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "bindings/cuda_launch.h"
#include "bindings/tensor_import.h"

#if ATTNPREP_WITH_CUDA
#include "cuda/launch.h"
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
    // The Metal kernel ships as source in every build; torch compiles and
    // runs it on Apple GPUs.
#if defined(__APPLE__)
    info["metal"] = true;
#else
    info["metal"] = false;
#endif
    info["dlpack_path"] = dlpack_path();
    return info;
  });
#if ATTNPREP_WITH_CUDA
  // Test and benchmark switches: programmatic dependent launch (src/cuda/launch.h).
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
#endif
}

}  // namespace attnprep::bindings
