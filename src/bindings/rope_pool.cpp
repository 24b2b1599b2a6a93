// Python binding of rope_pool_fused (docs/contract.md).
#include <nanobind/stl/string.h>

#include "bindings/cuda_launch.h"
#include "bindings/tensor_import.h"
#include "core/rope_pool.h"

#if ATTNPREP_WITH_CUDA
#include "cuda/rope_pool.h"
#endif

namespace attnprep::bindings {
namespace {

constexpr const char* kOp = "rope_pool_fused";

struct Imported {
  ImportedTensor q, k, v, positions, slots, k_pool, v_pool, cache, k_scale, v_scale, q_norm, k_norm, q_scale;
  core::RopePoolArgs args;
};

// The scalar arguments, as Python passes them (converted and range-checked
// here so that a wrong type is a TypeError in the op's words, not nanobind's
// signature dump).
struct Scalars {
  nb::handle head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim, is_neox, inplace;
};

// The optional arguments of the KV formats: fp8 scales and the paged layout.
struct KvFormat {
  nb::handle k_scale, v_scale, kv_layout;
};

// The optional arguments of the per-head QK norm.
struct QkNorm {
  nb::handle q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset;
};

// The optional arguments added after the QK norm: M-RoPE's, then fp8 q's.
struct Later {
  nb::handle mrope_section, mrope_interleaved, q_scale;
};

// mrope_section: None, or a list or tuple of ints (their count and values
// are check_rope_pool's).
void mrope_arg(const Later& m, core::RopePoolArgs& a) {
  a.mrope_interleaved = bool_arg(m.mrope_interleaved, kOp, "mrope_interleaved");
  if (m.mrope_section.is_none()) return;
  if (!nb::isinstance<nb::list>(m.mrope_section) && !nb::isinstance<nb::tuple>(m.mrope_section))
    throw nb::type_error(("rope_pool_fused: mrope_section must be a list or tuple of ints, got " +
                          nb::cast<std::string>(m.mrope_section.type().attr("__name__")))
                             .c_str());
  a.has_mrope_section = true;
  for (nb::handle n : m.mrope_section) a.mrope_section.push_back(int_arg(n, kOp, "mrope_section"));
}

core::KvLayout layout_arg(nb::handle obj) {
  if (!nb::isinstance<nb::str>(obj))
    throw nb::type_error(
        ("rope_pool_fused: kv_layout must be a str, got " + nb::cast<std::string>(obj.type().attr("__name__")))
            .c_str());
  return core::parse_kv_layout(nb::cast<std::string>(obj));
}

// Imports every argument, in the signature's order (the first of the wrong
// type names itself); check_rope_pool(in.args) validates them.
Imported import_args(Import import, nb::handle q, nb::handle k, nb::handle v, nb::handle positions, nb::handle slots,
                     nb::handle k_pool, nb::handle v_pool, const Scalars& sc, nb::handle cos_sin_cache,
                     const KvFormat& kv, const QkNorm& nm, const Later& mr) {
  Imported in;
  core::RopePoolArgs& a = in.args;
  in.q = import(q, "q");
  in.k = import(k, "k");
  const bool has_v = import_optional(import, v, "v", in.v, a.v);
  const bool has_positions = import_optional(import, positions, "positions", in.positions, a.positions);
  const bool has_slots = import_optional(import, slots, "slots", in.slots, a.slots);
  const bool has_k_pool = import_optional(import, k_pool, "k_pool", in.k_pool, a.k_pool);
  const bool has_v_pool = import_optional(import, v_pool, "v_pool", in.v_pool, a.v_pool);
  core::check_cache_write_given(has_v, has_slots, has_k_pool, has_v_pool);
  a.has_pool = has_v;
  a.q = in.q.arg;
  a.k = in.k.arg;
  a.has_positions = has_positions;
  a.head_dim = int_arg(sc.head_dim, kOp, "head_dim");
  a.num_qo_heads = int_arg(sc.num_qo_heads, kOp, "num_qo_heads");
  a.num_kv_heads = int_arg(sc.num_kv_heads, kOp, "num_kv_heads");
  a.rope_base = float_arg(sc.rope_base, kOp, "rope_base");
  a.has_rotary_dim = !sc.rotary_dim.is_none();
  if (a.has_rotary_dim) a.rotary_dim = int_arg(sc.rotary_dim, kOp, "rotary_dim");
  a.is_neox = bool_arg(sc.is_neox, kOp, "is_neox");
  a.has_cache = import_optional(import, cos_sin_cache, "cos_sin_cache", in.cache, a.cos_sin_cache);
  a.inplace = bool_arg(sc.inplace, kOp, "inplace");
  a.has_k_scale = import_optional(import, kv.k_scale, "k_scale", in.k_scale, a.k_scale);
  a.has_v_scale = import_optional(import, kv.v_scale, "v_scale", in.v_scale, a.v_scale);
  a.kv_layout = layout_arg(kv.kv_layout);
  a.has_q_norm = import_optional(import, nm.q_norm_weight, "q_norm_weight", in.q_norm, a.q_norm_weight);
  a.has_k_norm = import_optional(import, nm.k_norm_weight, "k_norm_weight", in.k_norm, a.k_norm_weight);
  a.norm_eps = float_arg(nm.norm_eps, kOp, "norm_eps");
  a.norm_offset = float_arg(nm.norm_weight_offset, kOp, "norm_weight_offset");
  mrope_arg(mr, a);
  a.has_q_scale = import_optional(import, mr.q_scale, "q_scale", in.q_scale, a.q_scale);
  return in;
}

Imported import_and_check(Import import, nb::handle q, nb::handle k, nb::handle v, nb::handle positions,
                          nb::handle slots, nb::handle k_pool, nb::handle v_pool, const Scalars& sc,
                          nb::handle cos_sin_cache, const KvFormat& kv, const QkNorm& nm, const Later& mr) {
  Imported in = import_args(import, q, k, v, positions, slots, k_pool, v_pool, sc, cos_sin_cache, kv, nm, mr);
  core::check_rope_pool(in.args);
  return in;
}

// Validates, allocates q_rot/k_rot (unless inplace) and launches; returns (q_rot, k_rot, k_pool, v_pool). Returns None
// for MPS tensors before the checks: their torch-registered kernel (python/attnprep/metal.py) runs the same checks.
nb::object rope_pool_fused(nb::handle q, nb::handle k, nb::handle v, nb::handle positions, nb::handle slots,
                           nb::handle k_pool, nb::handle v_pool, nb::handle head_dim, nb::handle num_qo_heads,
                           nb::handle num_kv_heads, nb::handle rope_base, nb::handle rotary_dim, nb::handle is_neox,
                           nb::handle cos_sin_cache, nb::handle inplace, nb::handle k_scale, nb::handle v_scale,
                           nb::handle kv_layout, nb::handle q_norm_weight, nb::handle k_norm_weight,
                           nb::handle norm_eps, nb::handle norm_weight_offset, nb::handle mrope_section,
                           nb::handle mrope_interleaved, nb::handle q_scale) {
  Imported in =
      import_args(import_tensor, q, k, v, positions, slots, k_pool, v_pool,
                  {head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim, is_neox, inplace}, cos_sin_cache,
                  {k_scale, v_scale, kv_layout}, {q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset},
                  {mrope_section, mrope_interleaved, q_scale});
  const core::RopePoolArgs& a = in.args;
  if (a.q.device.type == core::DeviceType::MPS) return nb::none();
  core::check_rope_pool(a);
  const bool inplace_ = a.inplace;

  nb::object q_rot, k_rot;
  core::TensorArg qo = a.q, ko = a.k;
  if (inplace_) {
    q_rot = nb::borrow(q);
    k_rot = nb::borrow(k);
  } else {
    NewTensor nq = a.has_q_scale ? new_e4m3_tensor_like(q, in.q, a.q.shape, 3) : new_tensor_like(q, in.q, a.q.shape, 3);
    NewTensor nk = new_tensor_like(k, in.k, a.k.shape, 3);
    q_rot = std::move(nq.tensor);
    k_rot = std::move(nk.tensor);
    qo = nq.arg;
    ko = nk.arg;
  }
  nb::object result = nb::make_tuple(q_rot, k_rot, nb::borrow(k_pool), nb::borrow(v_pool));  // None without pools
  if (a.q.size(0) == 0) return result;
  const RopePoolParams params = core::make_rope_pool_params(a, qo, ko);
#if ATTNPREP_WITH_CUDA
  const cuda::RopePoolPointers ptrs{a.q.data,
                                    a.k.data,
                                    a.has_pool ? a.v.data : nullptr,
                                    qo.data,
                                    ko.data,
                                    a.has_pool ? a.k_pool.data : nullptr,
                                    a.has_pool ? a.v_pool.data : nullptr,
                                    a.has_positions ? a.positions.data : nullptr,
                                    a.has_pool ? a.slots.data : nullptr,
                                    a.has_cache ? a.cos_sin_cache.data : nullptr,
                                    a.has_k_scale ? static_cast<const float*>(a.k_scale.data) : nullptr,
                                    a.has_v_scale ? static_cast<const float*>(a.v_scale.data) : nullptr,
                                    a.has_q_norm ? a.q_norm_weight.data : nullptr,
                                    a.has_k_norm ? a.k_norm_weight.data : nullptr,
                                    a.has_q_scale ? static_cast<const float*>(a.q_scale.data) : nullptr};
#endif
  ATTNPREP_RUN_CUDA("rope_pool_fused", a.q.device, stream, cuda::rope_pool(params, ptrs, a.q.dtype, stream));
  return result;
}

// Every check (on metadata alone when `metadata_only`: the fake kernel's
// half under torch.compile), nothing launched.
void rope_pool_check(nb::handle q, nb::handle k, nb::handle v, nb::handle positions, nb::handle slots,
                     nb::handle k_pool, nb::handle v_pool, nb::handle head_dim, nb::handle num_qo_heads,
                     nb::handle num_kv_heads, nb::handle rope_base, nb::handle rotary_dim, nb::handle is_neox,
                     nb::handle cos_sin_cache, nb::handle inplace, nb::handle k_scale, nb::handle v_scale,
                     nb::handle kv_layout, nb::handle q_norm_weight, nb::handle k_norm_weight, nb::handle norm_eps,
                     nb::handle norm_weight_offset, nb::handle mrope_section, nb::handle mrope_interleaved,
                     nb::handle q_scale, bool metadata_only) {
  import_and_check(metadata_only ? import_metadata : import_tensor, q, k, v, positions, slots, k_pool, v_pool,
                   {head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim, is_neox, inplace}, cos_sin_cache,
                   {k_scale, v_scale, kv_layout}, {q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset},
                   {mrope_section, mrope_interleaved, q_scale});
}

// The Metal dispatch (parameter block as bytes, threadgroups, threads per
// group) for checked arguments and the given outputs: python/attnprep/metal.py
// runs the kernel on torch's MPS stream with exactly these.
nb::tuple rope_pool_metal_plan(nb::handle q, nb::handle k, nb::handle v, nb::handle positions, nb::handle slots,
                               nb::handle k_pool, nb::handle v_pool, nb::handle head_dim, nb::handle num_qo_heads,
                               nb::handle num_kv_heads, nb::handle rope_base, nb::handle rotary_dim, nb::handle is_neox,
                               nb::handle cos_sin_cache, nb::handle inplace, nb::handle k_scale, nb::handle v_scale,
                               nb::handle kv_layout, nb::handle q_norm_weight, nb::handle k_norm_weight,
                               nb::handle norm_eps, nb::handle norm_weight_offset, nb::handle mrope_section,
                               nb::handle mrope_interleaved, nb::handle q_scale, nb::handle q_rot, nb::handle k_rot) {
  Imported in =
      import_and_check(import_tensor, q, k, v, positions, slots, k_pool, v_pool,
                       {head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim, is_neox, inplace}, cos_sin_cache,
                       {k_scale, v_scale, kv_layout}, {q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset},
                       {mrope_section, mrope_interleaved, q_scale});
  const core::TensorArg qo = import_tensor(q_rot, "q_rot").arg, ko = import_tensor(k_rot, "k_rot").arg;
  const core::MetalDispatch d = core::plan_rope_pool_metal(in.args, qo, ko);
  return nb::make_tuple(nb::bytes(reinterpret_cast<const char*>(&d.params), sizeof(d.params)), d.threadgroups,
                        d.threads_per_group);
}

}  // namespace

// The op's arguments in the extension's order (RopeArgs.for_extension), every one accepting None so that the checks
// above, not nanobind, report a wrong type.
#define ATTNPREP_ROPE_ARGS                                                                                             \
  nb::arg("q").none(), nb::arg("k").none(), nb::arg("v").none(), nb::arg("positions").none(), nb::arg("slots").none(), \
      nb::arg("k_pool").none(), nb::arg("v_pool").none(), nb::arg("head_dim").none(), nb::arg("num_qo_heads").none(),  \
      nb::arg("num_kv_heads").none(), nb::arg("rope_base").none(), nb::arg("rotary_dim").none(),                       \
      nb::arg("is_neox").none(), nb::arg("cos_sin_cache").none(), nb::arg("inplace").none(),                           \
      nb::arg("k_scale").none(), nb::arg("v_scale").none(), nb::arg("kv_layout").none(),                               \
      nb::arg("q_norm_weight").none(), nb::arg("k_norm_weight").none(), nb::arg("norm_eps").none(),                    \
      nb::arg("norm_weight_offset").none(), nb::arg("mrope_section").none(), nb::arg("mrope_interleaved").none(),      \
      nb::arg("q_scale").none()

void init_rope_pool(nb::module_& m) {
  m.def("rope_pool_fused", &rope_pool_fused, ATTNPREP_ROPE_ARGS,
        "Fused RoPE on q and k plus KV-pool scatter; returns (q_rot, k_rot, k_pool, v_pool), or None after "
        "the checks for MPS tensors (dispatched through torch).");
  m.def("rope_pool_check", &rope_pool_check, ATTNPREP_ROPE_ARGS, nb::arg("metadata_only") = false,
        "Runs rope_pool_fused's checks only (ValueError on failure).");
  m.def("rope_pool_metal_plan", &rope_pool_metal_plan, ATTNPREP_ROPE_ARGS, nb::arg("q_rot").none(),
        nb::arg("k_rot").none(), "(RopePoolParams bytes, threadgroups, threads per group) of the Metal kernel.");
}

#undef ATTNPREP_ROPE_ARGS

}  // namespace attnprep::bindings
