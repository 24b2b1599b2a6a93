// Python binding of pack_qkv_destination_major (docs/contract.md), and the
// Ulysses layer's internal GQA pack and geometry checks.
#include <nanobind/stl/vector.h>

#include "bindings/cuda_launch.h"
#include "bindings/tensor_import.h"
#include "core/pack_qkv.h"

#if ATTNPREP_WITH_CUDA
#include "cuda/pack_flat.h"
#include "cuda/strided_copy.h"
#endif

namespace attnprep::bindings {
namespace {

constexpr const char* kOp = "pack_qkv_destination_major";

// Every argument read (`import`: tensors with their addresses, or metadata
// alone), so a wrong type or layout is refused before the checks, and checks
// 1-5 run on q, k, v.
struct Inputs {
  ImportedTensor q, k, v, out;
  bool has_out = false;
  core::PackQkvShape shape;
};
Inputs import_inputs(ImportedTensor (*import)(nb::handle, const char*), nb::handle q, nb::handle k, nb::handle v,
                     nb::handle world_size, nb::handle out) {
  Inputs in{import(q, "q"), import(k, "k"), import(v, "v"), {}, false, {}};
  // past int64 either way: 0, which check 5 refuses after checks 1-4
  const int64_t world = int_arg(world_size, kOp, "world_size", 0);
  in.has_out = !out.is_none();
  if (in.has_out) in.out = import(out, "out");
  in.shape = core::check_pack_qkv_inputs(in.q.arg, in.k.arg, in.v.arg, world);
  return in;
}

nb::object pack_qkv_destination_major(nb::handle q, nb::handle k, nb::handle v, nb::handle world_size, nb::handle out) {
  const Inputs in = import_inputs(import_tensor, q, k, v, world_size, out);
  const ImportedTensor &tq = in.q, &tk = in.k, &tv = in.v;
  const core::PackQkvShape& shape = in.shape;

  nb::object result;
  core::TensorArg dst;
  if (!in.has_out) {
    core::check_pack_qkv_output_size(shape);
    NewTensor n = new_tensor_like(q, tq, shape.out_shape, 4);
    result = std::move(n.tensor);
    dst = n.arg;
  } else {
    dst = in.out.arg;
    core::check_pack_qkv_out(shape, tq.arg, tk.arg, tv.arg, dst);
    result = nb::borrow(out);
  }
  if (dst.numel() == 0) return result;

  core::PackFlatPlan flat;
  if (core::plan_pack_flat(shape, tq.arg, tk.arg, tv.arg, dst, flat)) {
    ATTNPREP_RUN_CUDA(kOp, tq.arg.device, stream, cuda::pack_flat(flat, stream));
    return result;
  }
  const core::StridedCopyPlan plan = core::plan_pack_qkv(shape, tq.arg, tk.arg, tv.arg, dst);
  ATTNPREP_RUN_CUDA(kOp, tq.arg.device, stream, cuda::strided_copy(plan, stream));
  return result;
}

// The fake kernel's half: every check on metadata alone (FakeTensors under
// torch.compile, meta tensors), and the output shape.
std::vector<int64_t> pack_qkv_meta(nb::handle q, nb::handle k, nb::handle v, nb::handle world_size, nb::handle out) {
  const Inputs in = import_inputs(import_metadata, q, k, v, world_size, out);
  if (in.has_out)
    core::check_pack_qkv_out(in.shape, in.q.arg, in.k.arg, in.v.arg, in.out.arg);
  else
    core::check_pack_qkv_output_size(in.shape);
  return {in.shape.out_shape, in.shape.out_shape + 4};
}

// Internal: the grouped (and chunked) pack of the Ulysses layer, [chunks,
// world, rows, n] (not part of the public API).
nb::object pack_qkv_gqa(nb::handle q, nb::handle k, nb::handle v, int64_t world_size, int64_t chunks) {
  const ImportedTensor tq = import_tensor(q, "q");
  const ImportedTensor tk = import_tensor(k, "k");
  const ImportedTensor tv = import_tensor(v, "v");
  const core::PackGqaShape shape = core::check_pack_qkv_gqa(tq.arg, tk.arg, tv.arg, world_size, chunks);
  NewTensor out = new_tensor_like(q, tq, shape.out_shape, 4);
  if (out.arg.numel() == 0) return std::move(out.tensor);
  const core::StridedCopyPlan plan = core::plan_pack_qkv_gqa(shape, tq.arg, tk.arg, tv.arg, out.arg);
  ATTNPREP_RUN_CUDA("ulysses pack", tq.arg.device, stream, cuda::strided_copy(plan, stream));
  return std::move(out.tensor);
}

void check_ulysses_geometry(nb::handle q, nb::handle k, nb::handle v, int64_t world_size) {
  core::check_ulysses_geometry(import_metadata(q, "q").arg, import_metadata(k, "k").arg, import_metadata(v, "v").arg,
                               world_size);
}

void check_ulysses_batched(nb::handle q, nb::handle k, nb::handle v, nb::handle key_padding_mask) {
  const ImportedTensor tq = import_metadata(q, "q"), tk = import_metadata(k, "k"), tv = import_metadata(v, "v");
  if (key_padding_mask.is_none()) return core::check_ulysses_batched(tq.arg, tk.arg, tv.arg, nullptr);
  const ImportedTensor mask = import_metadata(key_padding_mask, "key_padding_mask");
  core::check_ulysses_batched(tq.arg, tk.arg, tv.arg, &mask.arg);
}

}  // namespace

void init_pack_qkv(nb::module_& m) {
  m.def("pack_qkv_destination_major", &pack_qkv_destination_major, nb::arg("q").none(), nb::arg("k").none(),
        nb::arg("v").none(), nb::arg("world_size").none(), nb::arg("out").none() = nb::none(),
        "Pack q, k, v [rows, heads, head_size] into [world_size, rows, heads // world_size, "
        "3 * head_size] for one all_to_all_single. Returns `out` (allocated when None).");
  m.def("_pack_qkv_meta", &pack_qkv_meta, nb::arg("q").none(), nb::arg("k").none(), nb::arg("v").none(),
        nb::arg("world_size").none(), nb::arg("out").none() = nb::none(),
        "Internal (fake kernel): the checks on metadata alone; returns the output shape.");
  m.def("_pack_qkv_gqa", &pack_qkv_gqa, nb::arg("q").none(), nb::arg("k").none(), nb::arg("v").none(),
        nb::arg("world_size"), nb::arg("chunks") = 1,
        "Internal (Ulysses): [chunks, W, rows, (chunk_q + 2 * chunk_kv) * head_size].");
  m.def("_check_ulysses_chunks", &core::check_ulysses_chunks, nb::arg("local_q"), nb::arg("local_kv"),
        nb::arg("kv_split"), nb::arg("chunks"), "Internal: the chunk count's check (any device).");
  m.def("_check_ulysses_geometry", &check_ulysses_geometry, nb::arg("q").none(), nb::arg("k").none(),
        nb::arg("v").none(), nb::arg("world_size"),
        "Internal: the Ulysses layer's head-geometry checks (metadata only, any device).");
  m.def("_check_ulysses_batched", &check_ulysses_batched, nb::arg("q").none(), nb::arg("k").none(), nb::arg("v").none(),
        nb::arg("key_padding_mask").none(),
        "Internal: the Ulysses layer's checks of batched inputs and their key-padding mask (metadata only).");
}

}  // namespace attnprep::bindings
