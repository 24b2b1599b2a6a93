// Internal bindings of the Ulysses layer's fp8 wire kernels (docs/contract.md,
// core/wire.h). Each returns False, touching nothing, when the kernels do not
// take its tensors; the layer then produces the same bytes with torch ops.
#include "core/wire.h"
#include "bindings/cuda_launch.h"
#include "bindings/tensor_import.h"
#include "core/errors.h"
#include "core/pack_qkv.h"

#if ATTNPREP_WITH_CUDA
#include "cuda/wire.h"
#endif

namespace attnprep::bindings {
namespace {

constexpr const char* kOp = "ulysses wire";

core::WireFormat wire_format(int64_t code) {
  core::require(code == 1 || code == 2, "ulysses wire: unknown wire code");
  return static_cast<core::WireFormat>(code);
}

// The wire buffer: a contiguous uint8 tensor of `rows` rows on x's device.
void check_wire(const core::TensorArg& wire, const core::TensorArg& x, int64_t rows, int64_t blocks) {
  core::require(wire.dtype == core::DType::UInt8 && wire.is_contiguous() && wire.device == x.device &&
                    wire.numel() == rows * core::wire_row_bytes(blocks, x.size(-1)),
                "ulysses wire: the wire buffer does not match the tensors");
}

// Runs the plan when the kernels take it; false otherwise.
bool run(const core::StridedCopyPlan& copy, const core::TensorArg& like, const core::TensorArg& wire,
         const void* plain_base, int64_t blocks, int64_t plain_blocks, int64_t code, bool quantize) {
  const core::WireFormat format = wire_format(code);
  if (like.device.type != core::DeviceType::CUDA ||
      !core::wire_kernel_applies(copy, like.dtype, like.itemsize, like.size(-1), plain_blocks))
    return false;
  core::WirePlan plan;
  plan.copy = copy;
  plan.map = core::make_wire_map(plain_base, wire.data, blocks, like.size(-1), like.itemsize);
  plan.dtype = like.dtype;
  plan.format = format;
  plan.quantize = quantize;
  ATTNPREP_RUN_CUDA(kOp, like.device, stream, cuda::wire_transfer(plan, stream));
  return true;
}

// q, k, v [rows, heads, D] -> the wire rows [world, rows] of the layer's send
// buffer (pack_qkv_destination_major's layout for MHA, the grouped one else).
bool wire_pack_qkv(nb::handle q, nb::handle k, nb::handle v, int64_t world_size, int64_t code, nb::handle wire) {
  const ImportedTensor tq = import_tensor(q, "q"), tk = import_tensor(k, "k"), tv = import_tensor(v, "v");
  const ImportedTensor tw = import_tensor(wire, "wire");
  const core::TensorArg &aq = tq.arg, &ak = tk.arg, &av = tv.arg;
  core::TensorArg plain = aq;  // the plain send buffer's description: only its base address is used
  plain.data = tw.arg.data;
  int64_t blocks, rows = aq.size(0);
  core::StridedCopyPlan copy;
  if (ak.size(1) == aq.size(1)) {
    const core::PackQkvShape shape = core::check_pack_qkv_inputs(aq, ak, av, world_size);
    blocks = 3 * shape.local_heads;
    copy = core::plan_pack_qkv(shape, aq, ak, av, plain);
  } else {
    const core::PackGqaShape shape = core::check_pack_qkv_gqa(aq, ak, av, world_size, 1);
    blocks = shape.out_shape[3] / shape.head_size;
    copy = core::plan_pack_qkv_gqa(shape, aq, ak, av, plain);
  }
  check_wire(tw.arg, aq, world_size * rows, blocks);
  if (tw.arg.numel() == 0) return true;
  return run(copy, aq, tw.arg, tw.arg.data, blocks, world_size * rows * blocks, code, true);
}

// x [A, B, n, D] (strided) <-> wire rows [A, B]: quantize when `quantize`.
bool wire_view(nb::handle x, int64_t code, nb::handle wire, bool quantize) {
  const ImportedTensor tx = import_tensor(x, "x"), tw = import_tensor(wire, "wire");
  const core::TensorArg& a = tx.arg;
  core::require(a.ndim == 4, "ulysses wire: x must be [A, B, n, D]");
  check_wire(tw.arg, a, a.size(0) * a.size(1), a.size(2));
  if (a.numel() == 0) return true;
  if (a.stride(3) != 1) return false;
  const core::StridedCopyPlan copy = core::plan_wire_view(a, tw.arg.data, quantize);
  return run(copy, a, tw.arg, tw.arg.data, a.size(2), a.numel() / a.size(3), code, quantize);
}

}  // namespace

void init_wire(nb::module_& m) {
  m.def("_wire_row_bytes", &core::wire_row_bytes, nb::arg("blocks"), nb::arg("head_size"),
        "Internal (Ulysses fp8 wire): bytes of one wire row.");
  m.def("_wire_pack_qkv", &wire_pack_qkv, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("world_size"),
        nb::arg("code"), nb::arg("wire"),
        "Internal (Ulysses fp8 wire): pack and quantize q, k, v into `wire`; False if the kernel does not apply.");
  m.def(
      "_wire_quantize", [](nb::handle x, int64_t code, nb::handle wire) { return wire_view(x, code, wire, true); },
      nb::arg("x"), nb::arg("code"), nb::arg("wire"),
      "Internal (Ulysses fp8 wire): x [A, B, n, D] -> wire; False if the kernel does not apply.");
  m.def(
      "_wire_dequantize", [](nb::handle wire, int64_t code, nb::handle x) { return wire_view(x, code, wire, false); },
      nb::arg("wire"), nb::arg("code"), nb::arg("x"),
      "Internal (Ulysses fp8 wire): wire -> x [A, B, n, D] (written in place); False if the kernel does not apply.");
}

}  // namespace attnprep::bindings
