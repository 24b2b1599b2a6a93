// The extension module attnprep._C: one init_<family> per binding file.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

namespace attnprep::bindings {
void init_pack_qkv(nb::module_& m);
void init_build_info(nb::module_& m);
void init_usp_merge_heads(nb::module_& m);
void init_rope_pool(nb::module_& m);
void init_wire(nb::module_& m);
void init_peer(nb::module_& m);
void init_tensor_import(nb::module_& m);
}  // namespace attnprep::bindings

NB_MODULE(_C, m) {
  m.doc() = "attnprep kernels (CUDA / Metal) behind DLPack; see attnprep for the public API";
  attnprep::bindings::init_build_info(m);
  attnprep::bindings::init_pack_qkv(m);
  attnprep::bindings::init_usp_merge_heads(m);
  attnprep::bindings::init_rope_pool(m);
  attnprep::bindings::init_wire(m);
  attnprep::bindings::init_peer(m);
  attnprep::bindings::init_tensor_import(m);
}
