// torch tensor -> core::TensorArg, torch's current stream and torch-allocated outputs, without linking libtorch:
// through torch's C-level DLPack exchange table (torch >= 2.10, ~0.1 us a tensor, capture-safe), else `__dlpack__` plus
// calls to torch for the stream and allocation.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <vector>

#include "core/tensor.h"

namespace attnprep::bindings {

namespace nb = nanobind;

// Keeps whatever the import needed alive (the ndarray of the fallback path)
// for as long as the TensorArg is used.
struct ImportedTensor {
  core::TensorArg arg;
  nb::dlpack::dtype dl_dtype;  // as torch described it, to allocate alike
  nb::dlpack::device dl_device;
  nb::ndarray<> keepalive;
  std::vector<int64_t> full_shape;  // arg.full_shape, for metadata imports of over kMaxDims dims
};

// Views `obj` as a tensor. Raises TypeError naming `what` when it is not one.
// A tensor with no data (device "meta") is described by its metadata, with
// no address, so the checks reject its device with the documented message.
ImportedTensor import_tensor(nb::handle obj, const char* what);

// Describes `obj` from its Python metadata alone (shape, stride, dtype,
// device; no address): what the fake kernels check under torch.compile,
// where tensors are FakeTensors with no data.
ImportedTensor import_metadata(nb::handle obj, const char* what);

// `obj` as a Python int (an __index__ but not a bool), else TypeError "{op}: {name} must be an int, got {type}".
// Outside int64 it becomes `past_int64` when given, else saturates, so the op's range check refuses it in its turn.
int64_t int_arg(nb::handle obj, const char* op, const char* name, std::optional<int64_t> past_int64 = std::nullopt);
// `obj` as a number (int or float). TypeError "{op}: {name} must be a number, got {type}".
double float_arg(nb::handle obj, const char* op, const char* name);
// import_tensor or import_metadata (the fake kernels' half).
using Import = ImportedTensor (*)(nb::handle, const char*);

// An optional tensor argument: imported into `held` (which keeps it alive) unless None; returns whether it was given.
inline bool import_optional(Import import, nb::handle obj, const char* name, ImportedTensor& held,
                            core::TensorArg& arg) {
  if (obj.is_none()) return false;
  held = import(obj, name);
  arg = held.arg;
  return true;
}

// `obj` as a bool. TypeError "{op}: {name} must be a bool, got {type}".
bool bool_arg(nb::handle obj, const char* op, const char* name);

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
// The same of float8_e4m3fn (rope_pool_fused's fp8 q_rot).
NewTensor new_e4m3_tensor_like(nb::handle like_obj, const ImportedTensor& like, const int64_t* shape, int ndim);

// "exchange-api" or "dlpack-fallback": which path the first tensor took (or
// would take), for build_info().
const char* dlpack_path();

}  // namespace attnprep::bindings
