#include "core/tensor.h"

namespace attnprep::core {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::Float16: return "torch.float16";
    case DType::BFloat16: return "torch.bfloat16";
    case DType::Float32: return "torch.float32";
    case DType::Float64: return "torch.float64";
    case DType::Float8E4M3FN: return "torch.float8_e4m3fn";
    case DType::Float8E5M2: return "torch.float8_e5m2";
    case DType::Int8: return "torch.int8";
    case DType::UInt8: return "torch.uint8";
    case DType::Int16: return "torch.int16";
    case DType::Int32: return "torch.int32";
    case DType::Int64: return "torch.int64";
    case DType::Bool: return "torch.bool";
    case DType::Complex64: return "torch.complex64";
    case DType::Complex128: return "torch.complex128";
    case DType::Other: break;
  }
  return "unknown dtype";
}

int64_t TensorArg::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= size(d);
  return n;
}

bool TensorArg::is_contiguous() const {
  if (ndim > kMaxDims) return false;
  for (int d = 0; d < ndim; ++d)
    if (shape[d] == 0) return true;
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

bool TensorArg::same_shape(const TensorArg& o) const {
  if (ndim != o.ndim || ndim > kMaxDims) return false;
  for (int d = 0; d < ndim; ++d)
    if (shape[d] != o.shape[d]) return false;
  return true;
}

bool TensorArg::has_shape(std::initializer_list<int64_t> dims) const {
  if (static_cast<int>(dims.size()) != ndim) return false;
  int d = 0;
  for (int64_t s : dims)
    if (shape[d++] != s) return false;
  return true;
}

std::string shape_str(const TensorArg& t) {
  std::string s = "torch.Size([";
  for (int d = 0; d < t.ndim; ++d) {
    if (d) s += ", ";
    s += std::to_string(t.full_shape ? t.full_shape[d] : t.size(d));
  }
  return s + "])";
}

}  // namespace attnprep::core
