// The roofline planner (plan.h): plan(model, gpu, ep, batches, ...) -> dict, the JSON of
// `moekit plan --json`.
#include <fmt/format.h>
#include <nanobind/stl/string.h>

#include "bindings.h"
#include "moekit/plan.h"
#include "moekit/spec.h"

namespace nb = nanobind;

namespace moekit::py {

namespace {

nb::object plan_py(nb::handle model, nb::handle gpu, int ep, nb::handle batches, nb::handle tpot_sla, int64_t context,
                   double mem_fraction, const std::string& dtype) {
  PlanInput in;
  in.model = model_arg(model);
  in.gpu = gpu_arg(gpu);
  in.ep = ep;
  if (nb::isinstance<nb::str>(batches)) {
    in.batches = parse_batch_list(nb::cast<std::string>(batches));
  } else {
    try {
      for (nb::handle b : batches) in.batches.push_back(nb::cast<int64_t>(b));
    } catch (const std::exception&) {
      throw nb::type_error("batches must be a list of ints or a string such as \"1,8,64\" or \"1..1024\"");
    }
  }
  if (!tpot_sla.is_none())
    in.tpot_sla_ms = nb::isinstance<nb::str>(tpot_sla) ? parse_duration_ms(nb::cast<std::string>(tpot_sla))
                                                       : nb::cast<double>(tpot_sla);
  in.context = context;
  in.mem_fraction = mem_fraction;
  in.dtype = parse_dtype(dtype);
  return json_to_python(plan_to_json(plan(in)));
}

}  // namespace

void bind_plan(nb::module_& m) {
  m.def("plan", &plan_py, nb::arg("model"), nb::arg("gpu"), nb::arg("ep"), nb::arg("batches"),
        nb::arg("tpot_sla").none() = nb::none(), nb::arg("context") = 4096, nb::arg("mem_fraction") = 0.85,
        nb::arg("dtype") = "fp8",
        "The roofline plan of decode steps (plan.h) as the dict of `moekit plan --json`. model and gpu: a spec name, "
        "a JSON path or a dict; batches: a list of global batches or a string (\"1,8,64\", \"1..1024\"); tpot_sla: "
        "milliseconds or a string (\"30ms\").");
}

}  // namespace moekit::py
