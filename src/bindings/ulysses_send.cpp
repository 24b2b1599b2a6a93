// Binding of the one-pass Ulysses send side (internal: the layer's prologue calls it).
#include "core/ulysses_send.h"
#include "bindings/cuda_launch.h"
#include "bindings/tensor_import.h"

#if ATTNPREP_WITH_CUDA
#include "cuda/ulysses_send.h"
#endif

namespace attnprep::bindings {
namespace {

nb::object ulysses_send(nb::handle q, nb::handle k, nb::handle v, int64_t world, nb::handle q_norm_weight,
                        nb::handle k_norm_weight, double eps, double offset, nb::handle cos_sin, nb::handle positions,
                        int64_t rotary_dim, bool is_neox, int64_t wire, nb::handle wire_out, int64_t text_rows,
                        nb::handle q_text_weight, nb::handle k_text_weight) {
  const ImportedTensor tq = import_tensor(q, "q"), tk = import_tensor(k, "k"), tv = import_tensor(v, "v");
  const ImportedTensor tcs = import_tensor(cos_sin, "cos_sin");
  ImportedTensor tqw, tkw, tpos, twire, tqt, tkt;
  core::UlyssesSendArgs a;
  a.q = tq.arg, a.k = tk.arg, a.v = tv.arg, a.cos_sin = tcs.arg;
  a.world = world;
  a.has_q_norm = import_optional(import_tensor, q_norm_weight, "q_norm_weight", tqw, a.q_norm_weight);
  a.has_k_norm = import_optional(import_tensor, k_norm_weight, "k_norm_weight", tkw, a.k_norm_weight);
  a.has_positions = import_optional(import_tensor, positions, "positions", tpos, a.positions);
  a.eps = eps, a.offset = offset, a.rotary_dim = rotary_dim, a.is_neox = is_neox, a.wire = wire;
  a.text_rows = text_rows;
  if (text_rows != 0) {
    tqt = import_tensor(q_text_weight, "q_text_weight"), tkt = import_tensor(k_text_weight, "k_text_weight");
    a.q_text_weight = tqt.arg, a.k_text_weight = tkt.arg;
  }
  if (wire != 0) {
    twire = import_tensor(wire_out, "wire_out");
    a.wire_out = twire.arg;
  }
  int64_t shape[4];
  const core::UlyssesSendParams p = core::plan_ulysses_send(a, shape);
  NewTensor out;
  if (wire == 0) out = new_tensor_like(q, tq, shape, 4);
  nb::object result = wire == 0 ? std::move(out.tensor) : nb::borrow(wire_out);
  if (p.S * p.B == 0) return result;
#if ATTNPREP_WITH_CUDA
  void* dst = wire == 0 ? out.arg.data : a.wire_out.data;
  const cuda::UlyssesSendPointers ptr{a.q.data,
                                      a.k.data,
                                      a.v.data,
                                      a.has_q_norm ? a.q_norm_weight.data : nullptr,
                                      a.has_k_norm ? a.k_norm_weight.data : nullptr,
                                      a.text_rows > 0 ? a.q_text_weight.data : nullptr,
                                      a.text_rows > 0 ? a.k_text_weight.data : nullptr,
                                      static_cast<const float*>(a.cos_sin.data),
                                      a.has_positions ? a.positions.data : nullptr,
                                      dst};
#endif
  ATTNPREP_RUN_CUDA("ulysses send", tq.arg.device, stream, cuda::ulysses_send(p, ptr, a.q.dtype, stream));
  return result;
}

}  // namespace

void init_ulysses_send(nb::module_& m) {
  m.def("_ulysses_send", &ulysses_send, nb::arg("q").none(), nb::arg("k").none(), nb::arg("v").none(), nb::arg("world"),
        nb::arg("q_norm_weight").none(), nb::arg("k_norm_weight").none(), nb::arg("eps"), nb::arg("offset"),
        nb::arg("cos_sin").none(), nb::arg("positions").none(), nb::arg("rotary_dim"), nb::arg("is_neox"),
        nb::arg("wire") = 0, nb::arg("wire_out").none() = nb::none(), nb::arg("text_rows") = 0,
        nb::arg("q_text_weight").none() = nb::none(), nb::arg("k_text_weight").none() = nb::none(),
        "Internal: q and k normalized and rotated, q, k, v packed into the send buffer [world, S, B, n * D], or "
        "with wire 1/2 (e4m3/e5m2) as fp8 wire rows into wire_out [world, S, B, row_bytes]; rows s < text_rows take "
        "the text norm weights; returns it.");
}

}  // namespace attnprep::bindings
