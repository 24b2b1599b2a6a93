// Framework-free description of a tensor argument: what the checks and the
// launch plans need, nothing from torch, CUDA or Python. The bindings fill it
// from DLPack; the C++ tests build it by hand.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace attnprep::core {

enum class DeviceType : int32_t { CPU, CUDA, MPS, Other };

struct Device {
  DeviceType type = DeviceType::CPU;
  int32_t index = 0;
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

// Every torch dtype, so that a message names it as torch does and two never compare equal (torch.int4 and int8 are
// both 8-bit integers to DLPack); a newer one gets a value past `Other` with its name. Byte sizes are kept apart.
enum class DType : int32_t {
  Float16,
  BFloat16,
  Float32,
  Float64,
  Float8E4M3FN,
  Float8E5M2,
  Int8,
  UInt8,
  Int16,
  Int32,
  Int64,
  Bool,
  Complex64,
  Complex128,
  // no op computes with these; pack_qkv_destination_major copies them
  UInt16,
  UInt32,
  UInt64,
  Complex32,
  Float8E4M3FNUZ,
  Float8E5M2FNUZ,
  Float8E8M0FNU,
  Float4E2M1FNx2,
  Int1,
  Int2,
  Int3,
  Int4,
  Int5,
  Int6,
  Int7,
  UInt1,
  UInt2,
  UInt3,
  UInt4,
  UInt5,
  UInt6,
  UInt7,
  // torch cannot export these through DLPack: only fake tensors reach the checks with them
  Bits1x8,
  Bits2x4,
  Bits4x2,
  Bits8,
  Bits16,
  QInt8,
  QUInt8,
  QInt32,
  QUInt4x2,
  QUInt2x4,
  Other,
};

// The element types the rope kernels compute in, and the fp8 formats of their caches.
inline bool is_float_type(DType d) { return d == DType::Float16 || d == DType::BFloat16 || d == DType::Float32; }
inline bool is_fp8(DType d) { return d == DType::Float8E4M3FN || d == DType::Float8E5M2; }

// How torch prints the dtype: "torch.float64". Used in error messages.
const char* dtype_name(DType dtype);
// The dtype torch prints as `name` ("torch.float64"); a name of none above
// gets a value of its own past Other, the same for every call.
DType dtype_from_name(const std::string& name);

constexpr int kMaxDims = 8;

struct TensorArg {
  void* data = nullptr;  // first element (DLPack byte_offset applied)
  DType dtype = DType::Float32;
  int32_t itemsize = 4;  // bytes per element
  Device device{};
  int32_t ndim = 0;  // may exceed kMaxDims: then only the checks' "wrong rank" path uses it
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements, as torch reports them
  // Every dimension's size when ndim > kMaxDims (borrowed from the caller's
  // tensor for the duration of the call), so messages can still print it.
  const int64_t* full_shape = nullptr;
  // False for tensors known by metadata alone (meta and fake tensors): no
  // address, so the memory-overlap checks do not apply.
  bool has_address = true;

  // Dimensions past kMaxDims read as 0: checks test ndim first, and a wrong
  // rank must never index past the arrays.
  int64_t size(int d) const { return at(shape, d); }
  int64_t stride(int d) const { return at(strides, d); }
  // Bytes between consecutive indices of dimension d; 0 where d has at most one index or the tensor no elements (torch
  // lets such a stride be anything, 2^62 after as_strided, and the plans must not multiply it out).
  int64_t byte_stride(int d) const { return size(d) > 1 && numel() > 0 ? stride(d) * itemsize : 0; }
  int64_t numel() const;
  bool is_contiguous() const;  // torch's rule: size-1 dims may have any stride
  bool same_shape(const TensorArg& o) const;
  bool has_shape(std::initializer_list<int64_t> dims) const;

 private:
  int64_t at(const int64_t* a, int d) const {
    const int i = d < 0 ? d + ndim : d;
    return i >= 0 && i < ndim && i < kMaxDims ? a[i] : 0;
  }
};

// Whether a contiguous tensor of these sizes spans at most 2^63 - 1 bytes (a size of 0 counted as 1), as torch needs
// for an output; outputs of expanded or empty inputs can fail it.
bool fits_int64_bytes(std::initializer_list<int64_t> sizes, int64_t itemsize);

// Renders a shape as torch prints it: "torch.Size([4, 8, 64])".
std::string shape_str(const TensorArg& t);
// A device as torch prints it ("cuda:0", "mps:0", "cpu"; "another device"
// for the rest, meta tensors among them).
std::string device_str(const Device& device);
// "q: torch.bfloat16 on cuda:0, k: ...": the notes of the checks on dtypes
// and devices (core::ValueError::note).
std::string dtype_device_note(std::initializer_list<std::pair<const char*, const TensorArg*>> tensors);
// Throws ValueError(message) unless every tensor is on the first one's device; the note lists every tensor's device.
void require_one_device(const std::vector<std::pair<const char*, const TensorArg*>>& tensors, const char* message);
// "q: torch.Size([...]), k: ...": the notes of the checks on shapes.
std::string shape_note(std::initializer_list<std::pair<const char*, const TensorArg*>> tensors);

}  // namespace attnprep::core
