// SimulateResult as JSON: the machine form of `moekit simulate --json`.
#include <nlohmann/json.hpp>

#include "moekit/simulate.h"

namespace moekit {

std::string simulate_to_json(const SimulateResult& res) {
  using ojson = nlohmann::ordered_json;
  const SimulateInput& in = res.input;
  auto num_or_null = [](std::optional<double> v) { return v ? ojson(*v) : ojson(nullptr); };
  auto metric = [&](const Metric& m) {
    ojson j{{"simulated", m.simulated},
            {"std_error", m.std_error},
            {"closed_form", m.closed_form},
            {"gap", m.gap()},
            {"gap_in_se", num_or_null(m.gap_in_se(m.closed_form))},
            {"closed_form_assumes", m.closed_form_assumes}};
    if (m.reference) {
      j["reference"] = *m.reference;
      j["reference_gap"] = m.simulated - *m.reference;
      j["reference_gap_in_se"] = num_or_null(m.gap_in_se(*m.reference));
      j["reference_is"] = m.reference_is;
    } else {
      j["reference"] = nullptr;
    }
    return j;
  };
  ojson j{{"experts", in.num_experts},
          {"topk", in.topk},
          {"ranks", in.num_ranks},
          {"batch", in.batch},
          {"trials", in.trials},
          {"seed", in.seed},
          {"routing", to_string(in.routing)},
          {"placement", "contiguous: expert e on rank e / (E/P)"},
          {"coverage", metric(res.coverage)},
          {"dedup_targets", metric(res.dedup_targets)},
          {"s0", metric(res.s0)},
          {"cv_expert", metric(res.cv_expert)}};
  return j.dump(2);
}

}  // namespace moekit
