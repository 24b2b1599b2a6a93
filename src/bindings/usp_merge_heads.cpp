// Python binding of usp_merge_heads (docs/contract.md).
#include <nanobind/stl/vector.h>

#include "bindings/cuda_launch.h"
#include "bindings/tensor_import.h"
#include "core/usp_merge_heads.h"

#if ATTNPREP_WITH_CUDA
#include "cuda/strided_copy.h"
#endif

namespace attnprep::bindings {
namespace {

nb::object usp_merge_heads(nb::handle x) {
  const ImportedTensor tx = import_tensor(x, "x");
  int64_t shape[5];
  core::check_usp_merge_heads(tx.arg, shape);
  NewTensor out = new_tensor_like(x, tx, shape, 5);
  if (out.arg.numel() == 0) return std::move(out.tensor);
  const core::StridedCopyPlan plan = core::plan_usp_merge_heads(tx.arg, out.arg);
  ATTNPREP_RUN_CUDA("usp_merge_heads", tx.arg.device, stream, cuda::strided_copy(plan, stream));
  return std::move(out.tensor);
}

// The fake kernel's half: the checks on metadata alone, and the output shape.
std::vector<int64_t> usp_merge_heads_meta(nb::handle x) {
  int64_t shape[5];
  core::check_usp_merge_heads(import_metadata(x, "x").arg, shape);
  return {shape, shape + 5};
}

}  // namespace

void init_usp_merge_heads(nb::module_& m) {
  m.def("usp_merge_heads", &usp_merge_heads, nb::arg("x").none(),
        "[W, S, B, h_local, D] -> [B, S, W, h_local, D], contiguous; bit-exact with "
        "x.permute(2, 1, 0, 3, 4).contiguous().");
  m.def("_usp_merge_heads_meta", &usp_merge_heads_meta, nb::arg("x").none(),
        "Internal (fake kernel): the checks on metadata alone; returns the output shape.");
}

}  // namespace attnprep::bindings
