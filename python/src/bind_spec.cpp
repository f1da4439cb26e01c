// Specs as Python dicts (the JSON of spec.h's to_json, so the keys are the spec files' keys).
#include <fmt/format.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "moekit/spec.h"

namespace nb = nanobind;

namespace moekit::py {

namespace {
// A spec argument: a name / path (str) or a dict with the spec file's keys.
std::string spec_text(nb::handle spec, const char* name, bool& is_dict) {
  is_dict = nb::isinstance<nb::dict>(spec);
  if (is_dict) return nb::cast<std::string>(nb::module_::import_("json").attr("dumps")(spec));
  if (nb::isinstance<nb::str>(spec)) return nb::cast<std::string>(spec);
  throw nb::type_error(fmt::format("{} must be a spec name, a path to a JSON file or a dict, got {}", name,
                                   nb::type_name(spec.type()).c_str())
                           .c_str());
}

}  // namespace

ModelSpec model_arg(nb::handle spec) {
  bool is_dict = false;
  std::string text = spec_text(spec, "model", is_dict);
  return is_dict ? parse_model_spec(text, "model (dict)") : load_model_spec(text);
}

GpuSpec gpu_arg(nb::handle spec) {
  bool is_dict = false;
  std::string text = spec_text(spec, "gpu", is_dict);
  return is_dict ? parse_gpu_spec(text, "gpu (dict)") : load_gpu_spec(text);
}

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
