// Python binding of rope_pool_fused (SPEC.md section 3).
#include <nanobind/stl/string.h>

#include "bindings/cuda_launch.h"
#include "bindings/tensor_import.h"
#include "core/rope_pool.h"

#if ATTNPREP_WITH_CUDA
#include "cuda/rope_pool.h"
#endif

namespace attnprep::bindings {
namespace {

struct Imported {
  ImportedTensor q, k, v, positions, slots, k_pool, v_pool, cache;
  core::RopePoolArgs args;
};

Imported import_and_check(nb::handle q, nb::handle k, nb::handle v, nb::handle positions, nb::handle slots,
                          nb::handle k_pool, nb::handle v_pool, int64_t head_dim, int64_t num_qo_heads,
                          int64_t num_kv_heads, double rope_base, int64_t rotary_dim, bool is_neox,
                          nb::handle cos_sin_cache) {
  Imported in;
  in.q = import_tensor(q, "q");
  in.k = import_tensor(k, "k");
  in.v = import_tensor(v, "v");
  in.positions = import_tensor(positions, "positions");
  in.slots = import_tensor(slots, "slots");
  in.k_pool = import_tensor(k_pool, "k_pool");
  in.v_pool = import_tensor(v_pool, "v_pool");
  core::RopePoolArgs& a = in.args;
  a.q = in.q.arg;
  a.k = in.k.arg;
  a.v = in.v.arg;
  a.positions = in.positions.arg;
  a.slots = in.slots.arg;
  a.k_pool = in.k_pool.arg;
  a.v_pool = in.v_pool.arg;
  if (!cos_sin_cache.is_none()) {
    in.cache = import_tensor(cos_sin_cache, "cos_sin_cache");
    a.has_cache = true;
    a.cos_sin_cache = in.cache.arg;
  }
  a.head_dim = head_dim;
  a.num_qo_heads = num_qo_heads;
  a.num_kv_heads = num_kv_heads;
  a.rope_base = rope_base;
  a.rotary_dim = rotary_dim;
  a.is_neox = is_neox;
  core::check_rope_pool(a);
  return in;
}

// Validates, allocates q_rot/k_rot (unless inplace) and launches; returns
// (q_rot, k_rot, k_pool, v_pool) with the pools being the caller's objects.
nb::object rope_pool_fused(nb::handle q, nb::handle k, nb::handle v, nb::handle positions, nb::handle slots,
                           nb::handle k_pool, nb::handle v_pool, int64_t head_dim, int64_t num_qo_heads,
                           int64_t num_kv_heads, double rope_base, int64_t rotary_dim, bool is_neox,
                           nb::handle cos_sin_cache, bool inplace) {
  Imported in = import_and_check(q, k, v, positions, slots, k_pool, v_pool, head_dim, num_qo_heads, num_kv_heads,
                                 rope_base, rotary_dim, is_neox, cos_sin_cache);
  const core::RopePoolArgs& a = in.args;
  if (a.q.device.type != core::DeviceType::CUDA)
    throw std::runtime_error("rope_pool_fused: MPS tensors are dispatched by attnprep.metal, not this function");

  nb::object q_rot, k_rot;
  core::TensorArg qo = a.q, ko = a.k;
  if (inplace) {
    q_rot = nb::borrow(q);
    k_rot = nb::borrow(k);
  } else {
    NewTensor nq = new_tensor_like(q, in.q, a.q.shape, 3);
    NewTensor nk = new_tensor_like(k, in.k, a.k.shape, 3);
    q_rot = std::move(nq.tensor);
    k_rot = std::move(nk.tensor);
    qo = nq.arg;
    ko = nk.arg;
  }
  nb::object result = nb::make_tuple(q_rot, k_rot, nb::borrow(k_pool), nb::borrow(v_pool));
  if (a.q.size(0) == 0) return result;
  const RopePoolParams params = core::make_rope_pool_params(a, qo, ko);
#if ATTNPREP_WITH_CUDA
  const cuda::RopePoolPointers ptrs{a.q.data,      a.k.data,        a.v.data,     qo.data,
                                    ko.data,       a.k_pool.data,   a.v_pool.data, a.positions.data,
                                    a.slots.data,  a.has_cache ? a.cos_sin_cache.data : nullptr};
#endif
  ATTNPREP_RUN_CUDA("rope_pool_fused", a.q.device, stream, cuda::rope_pool(params, ptrs, a.q.dtype, stream));
  return result;
}

void rope_pool_check(nb::handle q, nb::handle k, nb::handle v, nb::handle positions, nb::handle slots,
                     nb::handle k_pool, nb::handle v_pool, int64_t head_dim, int64_t num_qo_heads,
                     int64_t num_kv_heads, double rope_base, int64_t rotary_dim, bool is_neox,
                     nb::handle cos_sin_cache) {
  import_and_check(q, k, v, positions, slots, k_pool, v_pool, head_dim, num_qo_heads, num_kv_heads, rope_base,
                   rotary_dim, is_neox, cos_sin_cache);
}

// The Metal dispatch (parameter block as bytes, threadgroups, threads per
// group) for checked arguments and the given outputs: python/attnprep/metal.py
// runs the kernel on torch's MPS stream with exactly these.
nb::tuple rope_pool_metal_plan(nb::handle q, nb::handle k, nb::handle v, nb::handle positions, nb::handle slots,
                               nb::handle k_pool, nb::handle v_pool, int64_t head_dim, int64_t num_qo_heads,
                               int64_t num_kv_heads, double rope_base, int64_t rotary_dim, bool is_neox,
                               nb::handle cos_sin_cache, nb::handle q_rot, nb::handle k_rot) {
  Imported in = import_and_check(q, k, v, positions, slots, k_pool, v_pool, head_dim, num_qo_heads, num_kv_heads,
                                 rope_base, rotary_dim, is_neox, cos_sin_cache);
  const core::TensorArg qo = import_tensor(q_rot, "q_rot").arg, ko = import_tensor(k_rot, "k_rot").arg;
  const core::MetalDispatch d = core::plan_rope_pool_metal(in.args, qo, ko);
  return nb::make_tuple(nb::bytes(reinterpret_cast<const char*>(&d.params), sizeof(d.params)), d.threadgroups,
                        d.threads_per_group);
}

}  // namespace

void init_rope_pool(nb::module_& m) {
  m.def("rope_pool_fused", &rope_pool_fused, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("positions"),
        nb::arg("slots"), nb::arg("k_pool"), nb::arg("v_pool"), nb::arg("head_dim"), nb::arg("num_qo_heads"),
        nb::arg("num_kv_heads"), nb::arg("rope_base"), nb::arg("rotary_dim") = -1, nb::arg("is_neox") = true,
        nb::arg("cos_sin_cache").none() = nb::none(), nb::arg("inplace") = false,
        "Fused RoPE on q and k plus KV-pool scatter; returns (q_rot, k_rot, k_pool, v_pool).");
  m.def("rope_pool_check", &rope_pool_check, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("positions"),
        nb::arg("slots"), nb::arg("k_pool"), nb::arg("v_pool"), nb::arg("head_dim"), nb::arg("num_qo_heads"),
        nb::arg("num_kv_heads"), nb::arg("rope_base"), nb::arg("rotary_dim") = -1, nb::arg("is_neox") = true,
        nb::arg("cos_sin_cache").none() = nb::none(),
        "Runs rope_pool_fused's checks only (ValueError on failure).");
  m.def("rope_pool_metal_plan", &rope_pool_metal_plan, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("positions"), nb::arg("slots"), nb::arg("k_pool"), nb::arg("v_pool"), nb::arg("head_dim"),
        nb::arg("num_qo_heads"), nb::arg("num_kv_heads"), nb::arg("rope_base"), nb::arg("rotary_dim"),
        nb::arg("is_neox"), nb::arg("cos_sin_cache").none(), nb::arg("q_rot"), nb::arg("k_rot"),
        "(RopePoolParams bytes, threadgroups, threads per group) of the Metal kernel.");
}

}  // namespace attnprep::bindings
