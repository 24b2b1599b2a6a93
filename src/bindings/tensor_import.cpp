#include "bindings/tensor_import.h"

#include "core/errors.h"

#include <Python.h>
#include <nanobind/stl/string.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>

namespace attnprep::bindings {

std::string str_of(nb::handle obj);  // below

namespace {

using nb::dlpack::dltensor;

// The parts of the DLPack >= 1.2 C exchange table that we call. The layout is
// the ABI published in dlpack.h (`DLPackExchangeAPI`); only major version 1 is
// accepted.
struct DLPackVersion {
  uint32_t major, minor;
};
struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned*);
  uint64_t flags;
  dltensor dl_tensor;
};
struct ExchangeApiHeader {
  DLPackVersion version;
  ExchangeApiHeader* prev_api;
};
struct ExchangeApi {
  ExchangeApiHeader header;
  int (*managed_tensor_allocator)(dltensor* prototype, DLManagedTensorVersioned** out, void* error_ctx,
                                  void (*set_error)(void* error_ctx, const char* kind, const char* message));
  int (*managed_tensor_from_py_object_no_sync)(void* py_object, DLManagedTensorVersioned** out);
  int (*managed_tensor_to_py_object_no_sync)(DLManagedTensorVersioned* tensor, void** out_py_object);
  int (*dltensor_from_py_object_no_sync)(void* py_object, dltensor* out);
  int (*current_work_stream)(int32_t device_type, int32_t device_id, void** out_stream);
};

constexpr int32_t kDLCPU = 1, kDLCUDA = 2, kDLMetal = 8;

// One cached lookup per Python type (torch.Tensor in practice; subclasses such
// as nn.Parameter inherit the attribute and get their own entry).
struct ApiCache {
  PyTypeObject* type = nullptr;
  const ExchangeApi* api = nullptr;
};
thread_local ApiCache cache;
const char* g_path = nullptr;

const ExchangeApi* exchange_api(PyTypeObject* type) {
  if (cache.type == type) return cache.api;
  const ExchangeApi* api = nullptr;
  if (std::getenv("ATTNPREP_DISABLE_EXCHANGE_API") == nullptr) {
    PyObject* capsule = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), "__dlpack_c_exchange_api__");
    if (capsule == nullptr) {
      PyErr_Clear();
    } else {
      auto* p = static_cast<const ExchangeApi*>(PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
      if (p == nullptr) PyErr_Clear();
      // The table must not outlive the capsule: torch keeps it in a static.
      Py_DECREF(capsule);
      if (p != nullptr && p->header.version.major == 1 && p->header.version.minor >= 2 &&
          p->dltensor_from_py_object_no_sync != nullptr)
        api = p;
    }
  }
  cache.type = type;
  cache.api = api;
  if (g_path == nullptr) g_path = api ? "exchange-api" : "dlpack-fallback";
  return api;
}

// DLPack's type codes (dlpack.h, DLDataTypeCode) that torch exports.
enum : uint8_t {
  kInt = 0,
  kUInt = 1,
  kFloat = 2,
  kBFloat = 4,
  kComplex = 5,
  kBool = 6,
  kF8E4M3FN = 10,
  kF8E4M3FNUZ = 11,
  kF8E5M2 = 12,
  kF8E5M2FNUZ = 13,
  kF8E8M0FNU = 14,
  kF4E2M1FN = 17,
};

core::DType to_dtype(uint8_t code, uint8_t bits, uint16_t lanes) {
  using core::DType;
  switch (code) {
    case kFloat:
      return bits == 16 ? DType::Float16 : bits == 32 ? DType::Float32 : bits == 64 ? DType::Float64 : DType::Other;
    case kBFloat:
      return bits == 16 ? DType::BFloat16 : DType::Other;
    // 8 bits is also torch.int1 ... torch.int7 (torch.uint1 ... uint7): import_tensor asks torch which
    case kInt:
      return bits == 8    ? DType::Int8
             : bits == 16 ? DType::Int16
             : bits == 32 ? DType::Int32
             : bits == 64 ? DType::Int64
                          : DType::Other;
    case kUInt:
      return bits == 8    ? DType::UInt8
             : bits == 16 ? DType::UInt16
             : bits == 32 ? DType::UInt32
             : bits == 64 ? DType::UInt64
                          : DType::Other;
    case kBool:
      return DType::Bool;
    case kComplex:
      return bits == 32    ? DType::Complex32
             : bits == 64  ? DType::Complex64
             : bits == 128 ? DType::Complex128
                           : DType::Other;
    case kF8E4M3FN:
      return DType::Float8E4M3FN;
    case kF8E4M3FNUZ:
      return DType::Float8E4M3FNUZ;
    case kF8E5M2:
      return DType::Float8E5M2;
    case kF8E5M2FNUZ:
      return DType::Float8E5M2FNUZ;
    case kF8E8M0FNU:
      return DType::Float8E8M0FNU;
    case kF4E2M1FN:
      return bits == 4 && lanes == 2 ? DType::Float4E2M1FNx2 : DType::Other;
    default:
      return DType::Other;
  }
}

// Whether an output of dtype `d` is allocated from DLPack's description: not torch.int1 ... torch.uint7 (8-bit
// integers to DLPack) nor float4_e2m1fn_x2 (two lanes); torch.empty makes those.
bool dlpack_describes(core::DType d) {
  return !(d >= core::DType::Int1 && d <= core::DType::UInt7) && d != core::DType::Float4E2M1FNx2;
}

core::TensorArg to_arg(const dltensor& t, const char* what) {
  core::TensorArg a;
  a.dtype = to_dtype(t.dtype.code, t.dtype.bits, t.dtype.lanes);
  // torch.float4_e2m1fn_x2: two 4-bit lanes, one byte an element (sizes and strides count bytes)
  const bool packed = a.dtype == core::DType::Float4E2M1FNx2;
  if ((t.dtype.lanes != 1 && !packed) || t.dtype.bits * t.dtype.lanes % 8 != 0)
    throw nb::type_error((std::string(what) + " has a dtype attnprep cannot address").c_str());
  a.data = static_cast<unsigned char*>(t.data) + t.byte_offset;
  a.itemsize = t.dtype.bits * t.dtype.lanes / 8;
  const int32_t dev = t.device.device_type;
  a.device.type = dev == kDLCUDA    ? core::DeviceType::CUDA
                  : dev == kDLMetal ? core::DeviceType::MPS
                  : dev == kDLCPU   ? core::DeviceType::CPU
                                    : core::DeviceType::Other;
  a.device.index = t.device.device_id;
  a.ndim = t.ndim;
  if (t.ndim > core::kMaxDims) {  // no op takes that many: keep the shape for the message
    a.full_shape = t.shape;
    return a;
  }
  int64_t expected = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    a.shape[d] = t.shape[d];
    a.strides[d] = t.strides ? t.strides[d] : expected;  // NULL strides mean row-major
    if (!t.strides) expected *= t.shape[d];
  }
  return a;
}

std::string py_type_name(nb::handle obj) { return nb::cast<std::string>(obj.type().attr("__name__")); }

bool is_meta(nb::handle obj) {
  nb::object device = nb::getattr(obj, "device", nb::none());
  if (device.is_none()) return false;
  nb::object type = nb::getattr(device, "type", nb::none());
  return nb::isinstance<nb::str>(type) && nb::cast<std::string>(type) == "meta";
}

// A tensor that is not one strided block of memory (sparse, nested, mkldnn) has no DLPack description and torch's
// refusal reads as an internal error, so its layout is named; called only after a refusal and on the metadata path.
void require_strided(nb::handle obj, const char* what) {
  std::string layout;
  if (nb::cast<bool>(nb::getattr(obj, "is_nested", nb::bool_(false))))
    layout = "a nested tensor";
  else if (nb::object l = nb::getattr(obj, "layout", nb::none()); !l.is_none() && str_of(l) != "torch.strided")
    layout = str_of(l);
  if (!layout.empty()) throw core::ValueError(std::string(what) + " must be a strided tensor, got " + layout);
}

[[noreturn]] void not_a_tensor(nb::handle obj, const char* what) {
  std::string msg =
      std::string(what) + " must be a torch.Tensor, got " + nb::cast<std::string>(obj.type().attr("__name__"));
  throw nb::type_error(msg.c_str());
}

nb::module_& torch_module() {
  static nb::module_* torch = new nb::module_(nb::module_::import_("torch"));  // leaked: outlives atexit
  return *torch;
}

// Whether obj is a torch.Tensor (of any subclass): other objects with
// __dlpack__ (numpy arrays) are refused as the contract says.
bool is_torch_tensor(nb::handle obj) {
  static PyObject* tensor_type = torch_module().attr("Tensor").inc_ref().ptr();  // leaked: outlives atexit
  if (Py_TYPE(obj.ptr()) == reinterpret_cast<PyTypeObject*>(tensor_type)) return true;
  const int r = PyObject_IsInstance(obj.ptr(), tensor_type);
  if (r < 0) throw nb::python_error();
  return r == 1;
}

// Whether obj is an instance of numbers.<abc> (Integral or Real): Python's
// and numpy's scalars register there; bool and tensors are refused apart.
bool is_number(nb::handle obj, const char* abc) {
  static nb::module_* numbers = new nb::module_(nb::module_::import_("numbers"));  // leaked: outlives atexit
  const int r = PyObject_IsInstance(obj.ptr(), numbers->attr(abc).ptr());
  if (r < 0) throw nb::python_error();
  return r == 1;
}

// An int argument (real: false) or a number argument (real: true); a bool
// (numpy's too) or a tensor is neither.
bool is_number_arg(nb::handle obj, bool real) {
  if (PyLong_CheckExact(obj.ptr()) || (real && PyFloat_CheckExact(obj.ptr()))) return true;
  if (PyBool_Check(obj.ptr()) || is_torch_tensor(obj)) return false;
  return is_number(obj, real ? "Real" : "Integral");
}

}  // namespace

// The ints of a Python sequence (torch.Size, a stride tuple); symbolic
// sizes (dynamic shapes) become their hint through int().
// (Stable-ABI calls only: the wheel is abi3.)
std::vector<int64_t> int_list(nb::handle seq) {
  const Py_ssize_t n = PySequence_Size(seq.ptr());
  if (n < 0) throw nb::python_error();
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    nb::object item = nb::steal(PySequence_GetItem(seq.ptr(), i));
    if (!item) throw nb::python_error();
    nb::object v = nb::steal(PyNumber_Long(item.ptr()));
    if (!v) throw nb::python_error();
    out[static_cast<size_t>(i)] = PyLong_AsLongLong(v.ptr());
  }
  return out;
}

std::string str_of(nb::handle obj) {
  nb::object s = nb::steal(PyObject_Str(obj.ptr()));
  if (!s) throw nb::python_error();
  return nb::borrow<nb::str>(s).c_str();
}

ImportedTensor import_metadata(nb::handle obj, const char* what) {
  require_strided(obj, what);  // their shapes and strides are not one block's
  if (!nb::hasattr(obj, "shape") || !nb::hasattr(obj, "stride") || !nb::hasattr(obj, "dtype") ||
      !nb::hasattr(obj, "device"))
    not_a_tensor(obj, what);
  ImportedTensor out;
  core::TensorArg& a = out.arg;
  a.has_address = false;
  std::vector<int64_t> shape = int_list(obj.attr("shape"));
  std::vector<int64_t> stride = int_list(obj.attr("stride")());
  a.ndim = static_cast<int32_t>(shape.size());
  a.dtype = core::dtype_from_name(str_of(obj.attr("dtype")));
  a.itemsize = static_cast<int32_t>(PyLong_AsLong(obj.attr("element_size")().ptr()));
  nb::object device = obj.attr("device");
  const std::string type = str_of(device.attr("type"));
  a.device.type = type == "cuda"  ? core::DeviceType::CUDA
                  : type == "mps" ? core::DeviceType::MPS
                  : type == "cpu" ? core::DeviceType::CPU
                                  : core::DeviceType::Other;
  nb::object index = device.attr("index");
  a.device.index = index.is_none() ? 0 : static_cast<int32_t>(PyLong_AsLong(index.ptr()));
  if (a.ndim > core::kMaxDims) {
    out.full_shape = std::move(shape);
    a.full_shape = out.full_shape.data();
    return out;
  }
  for (int d = 0; d < a.ndim; ++d) {
    a.shape[d] = shape[static_cast<size_t>(d)];
    a.strides[d] = stride[static_cast<size_t>(d)];
  }
  return out;
}

namespace {
// `out` with the description of `obj` that DLPack gave; an 8-bit integer
// may be torch.int1 ... torch.int7 (uint), and a type code this build does
// not know is a newer torch's dtype, so torch names those.
ImportedTensor described(ImportedTensor out, nb::handle obj, const dltensor& t, const char* what) {
  out.arg = to_arg(t, what);
  if (out.arg.dtype == core::DType::Int8 || out.arg.dtype == core::DType::UInt8 || out.arg.dtype == core::DType::Other)
    out.arg.dtype = core::dtype_from_name(str_of(obj.attr("dtype")));
  out.dl_dtype = t.dtype;
  out.dl_device = t.device;
  return out;
}
}  // namespace

ImportedTensor import_tensor(nb::handle obj, const char* what) {
  if (!is_torch_tensor(obj)) not_a_tensor(obj, what);
  ImportedTensor out;
  if (const ExchangeApi* api = exchange_api(Py_TYPE(obj.ptr()))) {
    dltensor t;
    if (api->dltensor_from_py_object_no_sync(obj.ptr(), &t) != 0) {
      // Only a tensor without data falls back to its metadata: any other
      // refusal (a conjugate or negative view, say) is torch's to report,
      // since copying the raw memory would lose what the view means.
      nb::python_error refusal;  // takes the pending Python error
      if (is_meta(obj)) return import_metadata(obj, what);
      require_strided(obj, what);
      throw refusal;
    }
    return described(std::move(out), obj, t, what);
  }
  if (!nb::hasattr(obj, "__dlpack__")) not_a_tensor(obj, what);
  if (is_meta(obj)) return import_metadata(obj, what);
  if (!nb::try_cast(obj, out.keepalive, false)) {
    require_strided(obj, what);
    obj.attr("__dlpack__")();  // raises torch's own reason, if it has one
    not_a_tensor(obj, what);
  }
  dltensor t;
  t.data = out.keepalive.data_handle();
  t.byte_offset = out.keepalive.byte_offset();
  t.device.device_type = out.keepalive.device_type();
  t.device.device_id = out.keepalive.device_id();
  t.ndim = static_cast<int32_t>(out.keepalive.ndim());
  t.dtype = out.keepalive.dtype();
  t.shape = const_cast<int64_t*>(out.keepalive.shape_ptr());
  t.strides = const_cast<int64_t*>(out.keepalive.stride_ptr());
  return described(std::move(out), obj, t, what);
}

int64_t int_arg(nb::handle obj, const char* op, const char* name, std::optional<int64_t> past_int64) {
  if (!is_number_arg(obj, false))
    throw nb::type_error((std::string(op) + ": " + name + " must be an int, got " + py_type_name(obj)).c_str());
  nb::object index = nb::steal(PyNumber_Index(obj.ptr()));
  if (!index) throw nb::python_error();
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow != 0) return past_int64 ? *past_int64 : overflow > 0 ? INT64_MAX : INT64_MIN;
  if (v == -1 && PyErr_Occurred()) throw nb::python_error();
  return static_cast<int64_t>(v);
}

double float_arg(nb::handle obj, const char* op, const char* name) {
  if (!is_number_arg(obj, true))
    throw nb::type_error((std::string(op) + ": " + name + " must be a number, got " + py_type_name(obj)).c_str());
  // an Integral through int(): exact, and past double's range an OverflowError
  const bool integral = !PyFloat_Check(obj.ptr()) && (PyLong_Check(obj.ptr()) || is_number(obj, "Integral"));
  nb::object value = integral ? nb::steal(PyNumber_Index(obj.ptr())) : nb::borrow(obj);
  if (!value) throw nb::python_error();
  const double v = PyFloat_AsDouble(value.ptr());
  if (v == -1.0 && PyErr_Occurred()) {
    if (!PyErr_ExceptionMatches(PyExc_OverflowError)) throw nb::python_error();
    PyErr_Clear();  // an int past double's range: as good as infinite
    return PyObject_RichCompareBool(obj.ptr(), nb::int_(0).ptr(), Py_GT) ? HUGE_VAL : -HUGE_VAL;
  }
  return v;
}

bool bool_arg(nb::handle obj, const char* op, const char* name) {
  if (!PyBool_Check(obj.ptr()))
    throw nb::type_error((std::string(op) + ": " + name + " must be a bool, got " + py_type_name(obj)).c_str());
  return obj.ptr() == Py_True;
}

void* current_stream(const core::Device& device) {
  const int32_t type = device.type == core::DeviceType::CUDA ? kDLCUDA : kDLMetal;
  if (cache.api != nullptr) {
    void* stream = nullptr;
    if (cache.api->current_work_stream(type, device.index, &stream) != 0) throw nb::python_error();
    return stream;
  }
  if (device.type != core::DeviceType::CUDA) return nullptr;
  nb::object s = torch_module().attr("cuda").attr("current_stream")(device.index);
  return reinterpret_cast<void*>(nb::cast<uintptr_t>(s.attr("cuda_stream")));
}

namespace {
void set_error(void* ctx, const char* kind, const char* message) {
  *static_cast<std::string*>(ctx) = std::string(kind) + ": " + message;
}
}  // namespace

namespace {
// A new contiguous tensor on `like`'s device: of DLPack dtype `dt` through torch's allocator where DLPack can
// describe it (`describable`), else torch.empty of `torch_dtype`.
NewTensor allocate(nb::handle like_obj, const ImportedTensor& like, nb::dlpack::dtype dt, bool describable,
                   nb::handle torch_dtype, const int64_t* shape, int ndim) {
  NewTensor out;
  const ExchangeApi* api = exchange_api(Py_TYPE(like_obj.ptr()));
  if (api != nullptr && describable) {
    dltensor proto;
    proto.data = nullptr;
    proto.device = like.dl_device;
    proto.ndim = ndim;
    proto.dtype = dt;
    proto.shape = const_cast<int64_t*>(shape);
    proto.strides = nullptr;
    proto.byte_offset = 0;
    DLManagedTensorVersioned* managed = nullptr;
    std::string error;
    if (api->managed_tensor_allocator(&proto, &managed, &error, set_error) != 0 || managed == nullptr)
      throw std::runtime_error("attnprep: torch could not allocate the output: " + error);
    // Read the description first: the conversion takes ownership of `managed`.
    out.arg = to_arg(managed->dl_tensor, "output");
    void* py = nullptr;
    if (api->managed_tensor_to_py_object_no_sync(managed, &py) != 0) throw nb::python_error();
    out.tensor = nb::steal(static_cast<PyObject*>(py));
    return out;
  }
  nb::list dims;
  for (int d = 0; d < ndim; ++d) dims.append(shape[d]);
  out.tensor =
      torch_module().attr("empty")(dims, nb::arg("dtype") = torch_dtype, nb::arg("device") = like_obj.attr("device"));
  ImportedTensor t = import_tensor(out.tensor, "output");
  out.arg = t.arg;
  return out;
}
}  // namespace

NewTensor new_tensor_like(nb::handle like_obj, const ImportedTensor& like, const int64_t* shape, int ndim) {
  return allocate(like_obj, like, like.dl_dtype, dlpack_describes(like.arg.dtype), like_obj.attr("dtype"), shape, ndim);
}

NewTensor new_e4m3_tensor_like(nb::handle like_obj, const ImportedTensor& like, const int64_t* shape, int ndim) {
  nb::dlpack::dtype e4m3;
  e4m3.code = kF8E4M3FN;
  e4m3.bits = 8;
  e4m3.lanes = 1;
  return allocate(like_obj, like, e4m3, true, torch_module().attr("float8_e4m3fn"), shape, ndim);
}

void init_tensor_import(nb::module_& m) {
  m.def(
      "_imported_dtype",
      [](nb::handle x, bool metadata_only) {
        return std::string(
            core::dtype_name((metadata_only ? import_metadata(x, "x") : import_tensor(x, "x")).arg.dtype));
      },
      nb::arg("x"), nb::arg("metadata_only"),
      "Internal (tests): x's dtype as the checks see it, through the eager import or the fake kernels' one.");
}

const char* dlpack_path() {
  if (g_path == nullptr) {
    nb::object tensor_type = torch_module().attr("Tensor");
    exchange_api(reinterpret_cast<PyTypeObject*>(tensor_type.ptr()));
  }
  return g_path;
}

}  // namespace attnprep::bindings
