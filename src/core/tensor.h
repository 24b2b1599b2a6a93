// Framework-free description of a tensor argument: what the checks and the
// launch plans need, nothing from torch, CUDA or Python. The bindings fill it
// from DLPack; the C++ tests build it by hand.
#pragma once

#include <cstdint>
#include <string>

namespace attnprep::core {

enum class DeviceType : int32_t { CPU, CUDA, MPS, Other };

struct Device {
  DeviceType type = DeviceType::CPU;
  int32_t index = 0;
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

// The dtypes torch can hand over through DLPack. `Other` covers anything we
// can still copy bit for bit (the byte size is kept separately).
enum class DType : int32_t {
  Float16, BFloat16, Float32, Float64,
  Float8E4M3FN, Float8E5M2,
  Int8, UInt8, Int16, Int32, Int64, Bool,
  Complex64, Complex128,
  Other,
};

// How torch prints the dtype: "torch.float64". Used in error messages.
const char* dtype_name(DType dtype);

constexpr int kMaxDims = 8;

struct TensorArg {
  void* data = nullptr;            // first element (DLPack byte_offset applied)
  DType dtype = DType::Float32;
  int32_t itemsize = 4;            // bytes per element
  Device device{};
  int32_t ndim = 0;                // may exceed kMaxDims: then only the checks' "wrong rank" path uses it
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
  int64_t numel() const;
  bool is_contiguous() const;       // torch's rule: size-1 dims may have any stride
  bool same_shape(const TensorArg& o) const;
  bool has_shape(std::initializer_list<int64_t> dims) const;

 private:
  int64_t at(const int64_t* a, int d) const {
    const int i = d < 0 ? d + ndim : d;
    return i >= 0 && i < ndim && i < kMaxDims ? a[i] : 0;
  }
};

// Renders a shape as torch prints it: "torch.Size([4, 8, 64])".
std::string shape_str(const TensorArg& t);

}  // namespace attnprep::core
