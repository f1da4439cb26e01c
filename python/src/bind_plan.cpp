// The roofline planner (plan.h): plan(model, gpu, ep, batches, ...) -> dict, the JSON of
// `moekit plan --json`.
#include <fmt/format.h>
#include <nanobind/stl/string.h>

#include <limits>

#include "bindings.h"
#include "moekit/check.h"
#include "moekit/plan.h"
#include "moekit/spec.h"

namespace nb = nanobind;

namespace moekit::py {

namespace {

std::string repr_of(nb::handle h) { return nb::cast<std::string>(nb::repr(h)); }

// mtp: a Python int of any size. One beyond C's int gets the planner's range message (naming
// the value), not nanobind's generic TypeError.
int mtp_arg(nb::handle h) {
  if (!nb::isinstance<nb::int_>(h) || nb::isinstance<nb::bool_>(h))
    throw nb::type_error(fmt::format("mtp must be an int (tokens drafted per sequence and step), got {}", repr_of(h)).c_str());
  int64_t v = 0;
  if (nb::try_cast(h, v) && v >= std::numeric_limits<int>::min() && v <= std::numeric_limits<int>::max())
    return int(v);  // plan() checks the range
  throw Error(fmt::format("mtp = {} must be in [0, {}] (tokens drafted per sequence and step)", repr_of(h), kMaxMtp));
}

// accept: None (N + 1) or a number; its range is the planner's check.
std::optional<double> accept_arg(nb::handle h) {
  if (h.is_none()) return std::nullopt;
  if (nb::isinstance<nb::bool_>(h) || !(nb::isinstance<nb::int_>(h) || nb::isinstance<nb::float_>(h)))
    throw nb::type_error(fmt::format("accept must be a number (the mean accepted length) or None, got {}", repr_of(h)).c_str());
  double v = 0;
  if (!nb::try_cast(h, v))  // an int beyond a double's range
    throw Error(fmt::format("accept = {} must be in [1, mtp + 1] (the mean accepted length)", repr_of(h)));
  return v;
}

nb::object plan_py(nb::handle model, nb::handle gpu, int ep, nb::handle batches, nb::handle tpot_sla, int64_t context,
                   double mem_fraction, const std::string& dtype, nb::handle mtp, nb::handle accept) {
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
  in.mtp = mtp_arg(mtp);
  in.accept_length = accept_arg(accept);
  return json_to_python(plan_to_json(plan(in)));
}

}  // namespace

void bind_plan(nb::module_& m) {
  m.def("plan", &plan_py, nb::arg("model"), nb::arg("gpu"), nb::arg("ep"), nb::arg("batches"),
        nb::arg("tpot_sla").none() = nb::none(), nb::arg("context") = 4096, nb::arg("mem_fraction") = 0.85,
        nb::arg("dtype") = "fp8", nb::arg("mtp") = 0, nb::arg("accept").none() = nb::none(),
        "The roofline plan of decode steps (plan.h) as the dict of `moekit plan --json`. model and gpu: a spec name, "
        "a JSON path or a dict; batches: a list of global batches or a string (\"1,8,64\", \"1..1024\"); tpot_sla: "
        "milliseconds or a string (\"30ms\"); mtp: tokens drafted per sequence and step (speculative "
        "decoding), accept: their mean accepted length L in [1, mtp + 1] (None: mtp + 1, the optimistic bound).");
}

}  // namespace moekit::py
