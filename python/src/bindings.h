// python/src/bindings.h: one bind_<layer>() per binding source, called by module.cpp.
#pragma once

#include <nanobind/nanobind.h>

#include <string>

namespace moekit::py {

// The Python value of a JSON text (json.loads).
nanobind::object json_to_python(const std::string& text);

void bind_spec(nanobind::module_& m);
void bind_quant(nanobind::module_& m);
void bind_plan(nanobind::module_& m);
void bind_eplb(nanobind::module_& m);
void bind_gemm(nanobind::module_& m);
void bind_ep(nanobind::module_& m);

}  // namespace moekit::py
