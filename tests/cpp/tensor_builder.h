// Synthetic TensorArgs for tests: a shape, a dtype, a device and optional
// strides, backed (when asked) by host memory the test owns.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <random>
#include <vector>

#include "core/tensor.h"

namespace test {

using attnprep::core::Device;
using attnprep::core::DeviceType;
using attnprep::core::DType;
using attnprep::core::TensorArg;

inline int itemsize_of(DType d) {  // torch's element_size()
  switch (d) {
    case DType::Float16:
    case DType::BFloat16:
    case DType::Int16:
    case DType::UInt16:
    case DType::Bits16:
      return 2;
    case DType::Float32:
    case DType::Int32:
    case DType::UInt32:
    case DType::Complex32:
    case DType::QInt32:
      return 4;
    case DType::Float64:
    case DType::Int64:
    case DType::UInt64:
    case DType::Complex64:
    case DType::Other:
      return 8;
    case DType::Complex128:
      return 16;
    default:
      return 1;  // the 8-bit, packed and sub-byte ones
  }
}

inline TensorArg make(std::initializer_list<int64_t> shape, DType dtype = DType::BFloat16,
                      Device device = {DeviceType::CUDA, 0}, std::initializer_list<int64_t> strides = {}) {
  TensorArg t;
  t.dtype = dtype;
  t.itemsize = itemsize_of(dtype);
  t.device = device;
  t.ndim = static_cast<int32_t>(shape.size());
  int d = 0;
  for (int64_t s : shape) t.shape[d++] = s;
  int64_t expected = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.strides[i] = expected;
    // past int64 (huge dimensions of an empty tensor) the outer strides are 0, as expand makes them
    expected = t.shape[i] > 0 && expected > INT64_MAX / t.shape[i] ? 0 : expected * t.shape[i];
  }
  d = 0;
  for (int64_t s : strides) t.strides[d++] = s;
  // Aligned, never dereferenced, and 64 GiB apart: every made tensor is its
  // own allocation as far as the overlap checks can tell.
  static uintptr_t next = 0;
  t.data = reinterpret_cast<void*>(++next << 36);
  return t;
}

// Bytes a strided view spans (largest offset + 1 element).
inline int64_t span_bytes(const TensorArg& t) {
  int64_t last = 0;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] == 0) return 0;
    last += (t.shape[d] - 1) * t.strides[d];
  }
  return (last + 1) * t.itemsize;
}

// Host storage filled with random bytes; `t.data` points `offset_bytes` into it.
struct HostBuffer {
  std::vector<unsigned char> bytes;
  void attach(TensorArg& t, uint32_t seed, int64_t offset_bytes = 0) {
    bytes.assign(static_cast<size_t>(span_bytes(t) + offset_bytes + 16), 0);
    std::mt19937 rng(seed);
    for (auto& b : bytes) b = static_cast<unsigned char>(rng());
    t.data = bytes.data() + offset_bytes;
  }
};

}  // namespace test
