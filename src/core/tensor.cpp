#include "core/tensor.h"

#include "core/errors.h"

#include <deque>
#include <mutex>

namespace attnprep::core {

namespace {

// DType, in its order, as torch prints it.
constexpr const char* kDTypeNames[] = {
    "torch.float16",
    "torch.bfloat16",
    "torch.float32",
    "torch.float64",
    "torch.float8_e4m3fn",
    "torch.float8_e5m2",
    "torch.int8",
    "torch.uint8",
    "torch.int16",
    "torch.int32",
    "torch.int64",
    "torch.bool",
    "torch.complex64",
    "torch.complex128",
    "torch.uint16",
    "torch.uint32",
    "torch.uint64",
    "torch.complex32",
    "torch.float8_e4m3fnuz",
    "torch.float8_e5m2fnuz",
    "torch.float8_e8m0fnu",
    "torch.float4_e2m1fn_x2",
    "torch.int1",
    "torch.int2",
    "torch.int3",
    "torch.int4",
    "torch.int5",
    "torch.int6",
    "torch.int7",
    "torch.uint1",
    "torch.uint2",
    "torch.uint3",
    "torch.uint4",
    "torch.uint5",
    "torch.uint6",
    "torch.uint7",
    "torch.bits1x8",
    "torch.bits2x4",
    "torch.bits4x2",
    "torch.bits8",
    "torch.bits16",
    "torch.qint8",
    "torch.quint8",
    "torch.qint32",
    "torch.quint4x2",
    "torch.quint2x4",
};
static_assert(sizeof(kDTypeNames) / sizeof(kDTypeNames[0]) == static_cast<size_t>(DType::Other),
              "a name for every DType but Other");
constexpr size_t kKnown = static_cast<size_t>(DType::Other);

// Names of dtypes newer than this build, in the order first met (values past Other): each prints as torch names it
// and no two compare equal. A deque keeps returned names valid; bounded.
constexpr size_t kMaxNewer = 1024;
std::mutex newer_mutex;
std::deque<std::string>& newer_names() {
  static std::deque<std::string> names;
  return names;
}

}  // namespace

const char* dtype_name(DType dtype) {
  const auto i = static_cast<size_t>(dtype);
  if (i < kKnown) return kDTypeNames[i];
  std::lock_guard<std::mutex> lock(newer_mutex);
  return i > kKnown && i - kKnown - 1 < newer_names().size() ? newer_names()[i - kKnown - 1].c_str() : "unknown dtype";
}

DType dtype_from_name(const std::string& name) {
  for (size_t i = 0; i < kKnown; ++i)
    if (name == kDTypeNames[i]) return static_cast<DType>(i);
  std::lock_guard<std::mutex> lock(newer_mutex);
  std::deque<std::string>& names = newer_names();
  size_t i = 0;
  while (i < names.size() && names[i] != name) ++i;
  if (i == names.size()) {
    if (names.size() == kMaxNewer) return DType::Other;
    names.push_back(name);
  }
  return static_cast<DType>(kKnown + 1 + i);
}

int64_t TensorArg::numel() const {
  for (int d = 0; d < ndim; ++d)
    if (size(d) == 0) return 0;  // before any product: an empty tensor's other sizes may multiply past int64
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

bool fits_int64_bytes(std::initializer_list<int64_t> sizes, int64_t itemsize) {
  int64_t bytes = itemsize;
  for (int64_t s : sizes) {
    const int64_t m = s > 1 ? s : 1;
    if (bytes > INT64_MAX / m) return false;
    bytes *= m;
  }
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

std::string device_str(const Device& device) {
  switch (device.type) {
    case DeviceType::CPU:
      return "cpu";
    case DeviceType::CUDA:
      return "cuda:" + std::to_string(device.index);
    case DeviceType::MPS:
      return "mps:" + std::to_string(device.index);
    default:
      return "another device";
  }
}

std::string dtype_device_note(std::initializer_list<std::pair<const char*, const TensorArg*>> tensors) {
  std::string s;
  for (const auto& [name, t] : tensors)
    s += (s.empty() ? "" : ", ") + std::string(name) + ": " + dtype_name(t->dtype) + " on " + device_str(t->device);
  return s;
}

void require_one_device(const std::vector<std::pair<const char*, const TensorArg*>>& tensors, const char* message) {
  for (const auto& [name, t] : tensors) {
    if (t->device == tensors.front().second->device) continue;
    std::string note;
    for (const auto& [n, u] : tensors)
      note += (note.empty() ? "" : ", ") + std::string(n) + ": " + device_str(u->device);
    throw ValueError(message, note);
  }
}

std::string shape_note(std::initializer_list<std::pair<const char*, const TensorArg*>> tensors) {
  std::string s;
  for (const auto& [name, t] : tensors) s += (s.empty() ? "" : ", ") + std::string(name) + ": " + shape_str(*t);
  return s;
}

}  // namespace attnprep::core
