// How a torch tensor becomes a core::TensorArg, how a kernel finds torch's
// current stream, and how outputs come from torch's allocator, all without
// linking libtorch.
//
// Fast path (torch >= 2.10): the C-level DLPack exchange table that torch
// publishes as `torch.Tensor.__dlpack_c_exchange_api__`; a tensor is viewed
// in about 0.1 us with no synchronisation, which also keeps CUDA-graph
// capture intact. Fallback: nanobind's ndarray import (`__dlpack__`, a few us
// per tensor) plus a call to torch for the stream and for allocation.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <initializer_list>

#include "core/tensor.h"

namespace attnprep::bindings {

namespace nb = nanobind;

// Keeps whatever the import needed alive (the ndarray of the fallback path)
// for as long as the TensorArg is used.
struct ImportedTensor {
  core::TensorArg arg;
  nb::dlpack::dtype dl_dtype;    // as torch described it, to allocate alike
  nb::dlpack::device dl_device;
  nb::ndarray<> keepalive;
};

// Views `obj` as a tensor. Raises TypeError naming `what` when it is not one.
ImportedTensor import_tensor(nb::handle obj, const char* what);

// The current torch stream of `device` (CUDA: cudaStream_t; MPS: MTLCommandQueue's
// stream object as torch reports it), as an opaque pointer.
void* current_stream(const core::Device& device);

// A new contiguous torch tensor of `shape` with the dtype and device of
// `like`, allocated by torch. `result.arg` describes it.
struct NewTensor {
  nb::object tensor;
  core::TensorArg arg;
};
NewTensor new_tensor_like(nb::handle like_obj, const ImportedTensor& like, const int64_t* shape, int ndim);

// "exchange-api" or "dlpack-fallback": which path the first tensor took (or
// would take), for build_info().
const char* dlpack_path();

}  // namespace attnprep::bindings
