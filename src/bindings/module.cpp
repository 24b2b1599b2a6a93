// The extension module attnprep._C: one init_<family> per binding file.
#include <nanobind/nanobind.h>

#include "core/errors.h"

namespace nb = nanobind;

namespace attnprep::bindings {
void init_pack_qkv(nb::module_& m);
void init_build_info(nb::module_& m);
void init_usp_merge_heads(nb::module_& m);
void init_rope_pool(nb::module_& m);
void init_qk_norm_rope(nb::module_& m);
void init_mla_rope_pool(nb::module_& m);
void init_wire(nb::module_& m);
void init_peer(nb::module_& m);
void init_tensor_import(nb::module_& m);
void init_ulysses_send(nb::module_& m);
}  // namespace attnprep::bindings

namespace {
// core::ValueError -> ValueError with the message unchanged and the note
// (the offending values) attached as PEP 678 does (__notes__ where Python
// has no add_note, before 3.11).
void raise_value_error(const attnprep::core::ValueError& e) {
  nb::object exc = nb::steal(PyObject_CallFunction(PyExc_ValueError, "s", e.what()));
  if (!exc) return;  // the call's own error is set
  if (!e.note.empty()) {
    nb::str note(e.note.c_str());
    if (nb::hasattr(exc, "add_note"))
      exc.attr("add_note")(note);
    else {
      nb::list notes;
      notes.append(note);
      nb::setattr(exc, "__notes__", notes);
    }
  }
  PyErr_SetObject(PyExc_ValueError, exc.ptr());
}
}  // namespace

NB_MODULE(_C, m) {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const attnprep::core::ValueError& e) {
      raise_value_error(e);
    }
  });
  m.doc() = "attnprep kernels (CUDA / Metal) behind DLPack; see attnprep for the public API";
  attnprep::bindings::init_build_info(m);
  attnprep::bindings::init_pack_qkv(m);
  attnprep::bindings::init_usp_merge_heads(m);
  attnprep::bindings::init_rope_pool(m);
  attnprep::bindings::init_qk_norm_rope(m);
  attnprep::bindings::init_mla_rope_pool(m);
  attnprep::bindings::init_wire(m);
  attnprep::bindings::init_peer(m);
  attnprep::bindings::init_tensor_import(m);
  attnprep::bindings::init_ulysses_send(m);
}
