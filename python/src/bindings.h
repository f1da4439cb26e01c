// python/src/bindings.h: one bind_<layer>() per binding source, called by module.cpp.
#pragma once

#include <nanobind/nanobind.h>

#include <string>

#include "moekit/quant.h"
#include "moekit/spec.h"

namespace moekit::py {

// The Python value of a JSON text (json.loads).
nanobind::object json_to_python(const std::string& text);

// A spec argument: a name or JSON path (str) or a dict with the spec file's keys.
ModelSpec model_arg(nanobind::handle spec);
GpuSpec gpu_arg(nanobind::handle spec);

// "1x128" | "per-token" (the Python name of quant.h's Fp8Scaling); ValueError naming anything else.
Fp8Scaling fp8_scaling_arg(const std::string& name);

void bind_spec(nanobind::module_& m);
void bind_quant(nanobind::module_& m);
void bind_plan(nanobind::module_& m);
void bind_eplb(nanobind::module_& m);
void bind_gemm(nanobind::module_& m);
void bind_ep(nanobind::module_& m);
void bind_layer(nanobind::module_& m);
void bind_ep_cuda(nanobind::module_& m);     // only with MOEKIT_WITH_CUDA
void bind_layer_cuda(nanobind::module_& m);  // only with MOEKIT_WITH_CUDA

}  // namespace moekit::py
