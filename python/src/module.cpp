// The extension module moekit._core: registers moekit::Error as the Python exception
// moekit.Error (a ValueError, so `except ValueError` catches moekit's own checks as well as the
// binding's argument checks) and the bindings of each layer. The public Python API is the
// package moekit (python/moekit/__init__.py), which allocates outputs in the caller's framework
// and calls these functions; nothing here allocates a tensor.
#include <nanobind/nanobind.h>

#include "bindings.h"
#include "moekit/check.h"

namespace nb = nanobind;

NB_MODULE(_core, m) {
  m.doc() = "moekit's C++ core over DLPack (use the package `moekit`, not this module)";
  nb::exception<moekit::Error>(m, "Error", PyExc_ValueError);
#if defined(MOEKIT_WITH_CUDA)
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  moekit::py::bind_spec(m);
  moekit::py::bind_quant(m);
  moekit::py::bind_plan(m);
  moekit::py::bind_eplb(m);
  moekit::py::bind_gemm(m);
  moekit::py::bind_ep(m);
  moekit::py::bind_layer(m);
#if defined(MOEKIT_WITH_CUDA)
  moekit::py::bind_ep_cuda(m);
  moekit::py::bind_layer_cuda(m);
#endif
}
