// What this binary was built with, for attnprep.build_info().
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "bindings/cuda_launch.h"
#include "bindings/tensor_import.h"

#if ATTNPREP_WITH_CUDA
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
#endif
}

}  // namespace attnprep::bindings
