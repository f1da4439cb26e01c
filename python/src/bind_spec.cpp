// Specs as Python dicts (the JSON of spec.h's to_json, so the keys are the spec files' keys).
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "moekit/spec.h"

namespace nb = nanobind;

namespace moekit::py {

nb::object json_to_python(const std::string& text) { return nb::module_::import_("json").attr("loads")(text); }

void bind_spec(nb::module_& m) {
  m.def(
      "model_spec", [](const std::string& name_or_path) { return json_to_python(to_json(load_model_spec(name_or_path))); },
      nb::arg("name_or_path"), "An embedded model spec by name (\"deepseek-v3\") or a JSON file, validated, as a dict.");
  m.def(
      "gpu_spec", [](const std::string& name_or_path) { return json_to_python(to_json(load_gpu_spec(name_or_path))); },
      nb::arg("name_or_path"), "An embedded GPU spec by name (\"h200\") or a JSON file, validated, as a dict.");
  m.def("embedded_models", &embedded_model_names, "Names of the model specs built into moekit.");
  m.def("embedded_gpus", &embedded_gpu_names, "Names of the GPU specs built into moekit.");
}

}  // namespace moekit::py
