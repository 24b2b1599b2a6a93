// Python binding of mla_rope_pool_fused (docs/contract.md).
#include "core/mla_rope_pool.h"
#include "bindings/cuda_launch.h"
#include "bindings/tensor_import.h"

#if ATTNPREP_WITH_CUDA
#include "cuda/mla_rope_pool.h"
#endif

namespace attnprep::bindings {
namespace {

constexpr const char* kOp = "mla_rope_pool_fused";

struct Imported {
  ImportedTensor q, kv_c, k_pe, positions, slots, kv_cache, kpe_cache, cos_sin_cache, weight, cache_scale, q_scale;
  core::MlaRopeArgs args;
};

// The op's arguments after the tensors every call has, in the extension's order.
struct Options {
  nb::handle rope_base, is_neox, cos_sin_cache, kv_norm_weight, norm_eps, kpe_cache, cache_scale, q_scale, inplace;
};

// Imports every argument in the signature's order (the first of the wrong type names itself).
Imported import_args(Import import, nb::handle q, nb::handle kv_c, nb::handle k_pe, nb::handle positions,
                     nb::handle slots, nb::handle kv_cache, const Options& o) {
  Imported in;
  core::MlaRopeArgs& a = in.args;
  const std::pair<ImportedTensor*, std::pair<nb::handle, const char*>> required[] = {
      {&in.q, {q, "q"}},
      {&in.kv_c, {kv_c, "kv_c"}},
      {&in.k_pe, {k_pe, "k_pe"}},
      {&in.positions, {positions, "positions"}},
      {&in.slots, {slots, "slots"}},
      {&in.kv_cache, {kv_cache, "kv_cache"}}};
  for (const auto& [held, arg] : required) *held = import(arg.first, arg.second);
  a.q = in.q.arg;
  a.kv_c = in.kv_c.arg;
  a.k_pe = in.k_pe.arg;
  a.positions = in.positions.arg;
  a.slots = in.slots.arg;
  a.kv_cache = in.kv_cache.arg;
  a.rope_base = float_arg(o.rope_base, kOp, "rope_base");
  a.is_neox = bool_arg(o.is_neox, kOp, "is_neox");
  a.has_cache = import_optional(import, o.cos_sin_cache, "cos_sin_cache", in.cos_sin_cache, a.cos_sin_cache);
  a.has_norm = import_optional(import, o.kv_norm_weight, "kv_norm_weight", in.weight, a.kv_norm_weight);
  a.norm_eps = float_arg(o.norm_eps, kOp, "norm_eps");
  a.has_kpe_cache = import_optional(import, o.kpe_cache, "kpe_cache", in.kpe_cache, a.kpe_cache);
  a.has_cache_scale = import_optional(import, o.cache_scale, "cache_scale", in.cache_scale, a.cache_scale);
  a.has_q_scale = import_optional(import, o.q_scale, "q_scale", in.q_scale, a.q_scale);
  a.inplace = bool_arg(o.inplace, kOp, "inplace");
  return in;
}

// Validates, allocates q_rot and k_pe_rot (unless inplace) and launches; returns (q_rot, k_pe_rot, kv_cache,
// kpe_cache). Returns None for MPS tensors before the checks: their torch-registered kernel runs the same checks.
nb::object mla_rope_pool_fused(nb::handle q, nb::handle kv_c, nb::handle k_pe, nb::handle positions, nb::handle slots,
                               nb::handle kv_cache, nb::handle rope_base, nb::handle is_neox, nb::handle cos_sin_cache,
                               nb::handle kv_norm_weight, nb::handle norm_eps, nb::handle kpe_cache,
                               nb::handle cache_scale, nb::handle q_scale, nb::handle inplace) {
  Imported in = import_args(
      import_tensor, q, kv_c, k_pe, positions, slots, kv_cache,
      {rope_base, is_neox, cos_sin_cache, kv_norm_weight, norm_eps, kpe_cache, cache_scale, q_scale, inplace});
  const core::MlaRopeArgs& a = in.args;
  if (a.q.device.type == core::DeviceType::MPS) return nb::none();
  core::check_mla_rope_pool(a);
  nb::object q_rot = nb::borrow(q), k_pe_rot = nb::borrow(k_pe);
  core::TensorArg qo = a.q, po = a.k_pe;
  if (!a.inplace) {
    NewTensor nq = a.has_q_scale ? new_e4m3_tensor_like(q, in.q, a.q.shape, 3) : new_tensor_like(q, in.q, a.q.shape, 3);
    NewTensor np = new_tensor_like(k_pe, in.k_pe, a.k_pe.shape, 2);
    q_rot = std::move(nq.tensor);
    k_pe_rot = std::move(np.tensor);
    qo = nq.arg;
    po = np.arg;
  }
  nb::object result = nb::make_tuple(q_rot, k_pe_rot, nb::borrow(kv_cache), nb::borrow(kpe_cache));
  if (a.q.size(0) == 0) return result;
  const MlaRopeParams params = core::make_mla_rope_params(a, qo, po);
#if ATTNPREP_WITH_CUDA
  // a combined cache: the k_pe values follow kv_c's L in every row
  void* kpe = a.has_kpe_cache ? a.kpe_cache.data
                              : static_cast<unsigned char*>(a.kv_cache.data) + a.kv_c.size(1) * a.kv_cache.itemsize;
  const cuda::MlaRopePointers ptrs{a.q.data,
                                   a.kv_c.data,
                                   a.k_pe.data,
                                   qo.data,
                                   po.data,
                                   a.kv_cache.data,
                                   kpe,
                                   a.positions.data,
                                   a.slots.data,
                                   a.has_cache ? a.cos_sin_cache.data : nullptr,
                                   a.has_norm ? a.kv_norm_weight.data : nullptr,
                                   a.has_cache_scale ? static_cast<const float*>(a.cache_scale.data) : nullptr,
                                   a.has_q_scale ? static_cast<const float*>(a.q_scale.data) : nullptr};
#endif
  ATTNPREP_RUN_CUDA(kOp, a.q.device, stream, cuda::mla_rope_pool(params, ptrs, a.q.dtype, stream));
  return result;
}

// Every check (on metadata alone when `metadata_only`: the fake kernel's half), nothing launched.
void mla_rope_pool_check(nb::handle q, nb::handle kv_c, nb::handle k_pe, nb::handle positions, nb::handle slots,
                         nb::handle kv_cache, nb::handle rope_base, nb::handle is_neox, nb::handle cos_sin_cache,
                         nb::handle kv_norm_weight, nb::handle norm_eps, nb::handle kpe_cache, nb::handle cache_scale,
                         nb::handle q_scale, nb::handle inplace, bool metadata_only) {
  const Imported in = import_args(
      metadata_only ? import_metadata : import_tensor, q, kv_c, k_pe, positions, slots, kv_cache,
      {rope_base, is_neox, cos_sin_cache, kv_norm_weight, norm_eps, kpe_cache, cache_scale, q_scale, inplace});
  core::check_mla_rope_pool(in.args);
}

// The Metal dispatch (parameter block as bytes, threadgroups, threads per group) for checked arguments and the given
// outputs: python/attnprep/metal.py runs the kernel on torch's MPS stream with exactly these.
nb::tuple mla_rope_pool_metal_plan(nb::handle q, nb::handle kv_c, nb::handle k_pe, nb::handle positions,
                                   nb::handle slots, nb::handle kv_cache, nb::handle rope_base, nb::handle is_neox,
                                   nb::handle cos_sin_cache, nb::handle kv_norm_weight, nb::handle norm_eps,
                                   nb::handle kpe_cache, nb::handle cache_scale, nb::handle q_scale, nb::handle inplace,
                                   nb::handle q_rot, nb::handle k_pe_rot) {
  const Imported in = import_args(
      import_tensor, q, kv_c, k_pe, positions, slots, kv_cache,
      {rope_base, is_neox, cos_sin_cache, kv_norm_weight, norm_eps, kpe_cache, cache_scale, q_scale, inplace});
  core::check_mla_rope_pool(in.args);
  const core::MlaMetalDispatch d = core::plan_mla_rope_pool_metal(in.args, import_tensor(q_rot, "q_rot").arg,
                                                                  import_tensor(k_pe_rot, "k_pe_rot").arg);
  return nb::make_tuple(nb::bytes(reinterpret_cast<const char*>(&d.params), sizeof(d.params)), d.threadgroups,
                        d.threads_per_group);
}

}  // namespace

#define ATTNPREP_MLA_ARGS                                                                                          \
  nb::arg("q").none(), nb::arg("kv_c").none(), nb::arg("k_pe").none(), nb::arg("positions").none(),                \
      nb::arg("slots").none(), nb::arg("kv_cache").none(), nb::arg("rope_base").none(), nb::arg("is_neox").none(), \
      nb::arg("cos_sin_cache").none(), nb::arg("kv_norm_weight").none(), nb::arg("norm_eps").none(),               \
      nb::arg("kpe_cache").none(), nb::arg("cache_scale").none(), nb::arg("q_scale").none(), nb::arg("inplace").none()

void init_mla_rope_pool(nb::module_& m) {
  m.def("mla_rope_pool_fused", &mla_rope_pool_fused, ATTNPREP_MLA_ARGS,
        "MLA RoPE + latent-cache write; returns (q_rot, k_pe_rot, kv_cache, kpe_cache), or None after reading the "
        "arguments for MPS tensors.");
  m.def("mla_rope_pool_check", &mla_rope_pool_check, ATTNPREP_MLA_ARGS, nb::arg("metadata_only") = false,
        "Runs mla_rope_pool_fused's checks only (ValueError on failure).");
  m.def("mla_rope_pool_metal_plan", &mla_rope_pool_metal_plan, ATTNPREP_MLA_ARGS, nb::arg("q_rot").none(),
        nb::arg("k_pe_rot").none(), "(MlaRopeParams bytes, threadgroups, threads per group) of the Metal kernel.");
}

#undef ATTNPREP_MLA_ARGS

}  // namespace attnprep::bindings
