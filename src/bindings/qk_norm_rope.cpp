// Python bindings of qk_norm_rope's own checks (core/qk_norm_rope.h) and its per-token QK norm
// (core/token_rms_norm.h); python/attnprep/qk_norm_rope.py calls them.
#include "core/qk_norm_rope.h"
#include "bindings/cuda_launch.h"
#include "bindings/tensor_import.h"
#include "core/token_rms_norm.h"

#if ATTNPREP_WITH_CUDA
#include "cuda/token_rms_norm.h"
#endif

namespace attnprep::bindings {
namespace {

constexpr const char* kOp = "qk_norm_rope";

// qk_norm_rope's own checks, on metadata alone (fake tensors too).
void check_qk_norm_rope(nb::handle q, nb::handle k, nb::handle positions, bool mrope) {
  const ImportedTensor tq = import_metadata(q, "q"), tk = import_metadata(k, "k");
  ImportedTensor tp;
  if (!positions.is_none()) tp = import_metadata(positions, "positions");
  core::check_qk_norm_rope(tq.arg, tk.arg, positions.is_none() ? nullptr : &tp.arg, mrope);
}

// Checks (on metadata alone when `metadata_only`: the fake kernel's half), then launches unless metadata_only.
void qk_token_rms_norm(nb::handle x, nb::handle weight, nb::handle eps, nb::handle offset, nb::handle out,
                       bool metadata_only) {
  const auto import = metadata_only ? import_metadata : import_tensor;
  const ImportedTensor tx = import(x, "x"), tw = import(weight, "weight"), to = import(out, "out");
  core::TokenNormArgs a;
  a.x = tx.arg;
  a.weight = tw.arg;
  a.out = to.arg;
  a.eps = float_arg(eps, kOp, "norm_eps");
  a.offset = float_arg(offset, kOp, "norm_weight_offset");
  core::check_token_rms_norm(a);
  if (metadata_only) return;
  const TokenNormParams p = core::make_token_rms_norm_params(a);
  ATTNPREP_RUN_CUDA("qk_norm_rope", a.x.device, stream,
                    cuda::token_rms_norm(p, a.x.data, a.weight.data, a.out.data, a.x.dtype, stream));
}

// The Metal dispatch (parameter block as bytes, threadgroups, threads per group) for checked arguments:
// python/attnprep/metal.py runs the kernel on torch's MPS stream with exactly these.
nb::tuple qk_token_rms_norm_metal_plan(nb::handle x, nb::handle weight, nb::handle eps, nb::handle offset,
                                       nb::handle out) {
  core::TokenNormArgs a;
  a.x = import_tensor(x, "x").arg;
  a.weight = import_tensor(weight, "weight").arg;
  a.out = import_tensor(out, "out").arg;
  a.eps = float_arg(eps, kOp, "norm_eps");
  a.offset = float_arg(offset, kOp, "norm_weight_offset");
  core::check_token_rms_norm(a);
  const core::TokenNormMetalDispatch d = core::plan_token_rms_norm_metal(a);
  return nb::make_tuple(nb::bytes(reinterpret_cast<const char*>(&d.params), sizeof(d.params)), d.threadgroups,
                        d.threads_per_group);
}

}  // namespace

void init_qk_norm_rope(nb::module_& m) {
  m.def("_check_qk_norm_rope", &check_qk_norm_rope, nb::arg("q").none(), nb::arg("k").none(),
        nb::arg("positions").none(), nb::arg("mrope"), "Internal: qk_norm_rope's own checks (ValueError).");
  m.def("_qk_token_rms_norm", &qk_token_rms_norm, nb::arg("x").none(), nb::arg("weight").none(), nb::arg("eps").none(),
        nb::arg("offset").none(), nb::arg("out").none(), nb::arg("metadata_only") = false,
        "Internal (qk_norm_rope): the per-token QK norm of x [T, heads, head_dim] into out (x itself in place).");
  m.def("_qk_token_rms_norm_metal_plan", &qk_token_rms_norm_metal_plan, nb::arg("x").none(), nb::arg("weight").none(),
        nb::arg("eps").none(), nb::arg("offset").none(), nb::arg("out").none(),
        "Internal: (TokenNormParams bytes, threadgroups, threads per group) of the Metal kernel.");
}

}  // namespace attnprep::bindings
