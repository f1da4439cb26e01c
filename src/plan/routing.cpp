// Routing distributions of the simulator: parsing "uniform", "zipf:S", "hot:H:R" and the
// weight of each expert (see include/moekit/simulate.h).
#include <fmt/format.h>

#include <charconv>
#include <cmath>

#include "moekit/check.h"
#include "moekit/simulate.h"

namespace moekit {

namespace {

double parse_real(std::string_view text, std::string_view whole, const char* what) {
  double v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  MOEKIT_CHECK(ec == std::errc() && ptr == text.data() + text.size() && !text.empty(),
               fmt::format("--routing '{}': {} '{}' is not a number (expected uniform, zipf:S or hot:H:R)", whole,
                           what, text));
  return v;
}

void check_routing(const Routing& r) {
  if (r.kind == Routing::Kind::zipf)
    MOEKIT_CHECK(std::isfinite(r.zipf_s) && r.zipf_s >= 0,
                 fmt::format("--routing zipf:{}: the exponent S must be >= 0", r.zipf_s));
  if (r.kind == Routing::Kind::hot) {
    MOEKIT_CHECK(r.hot_count >= 1, fmt::format("--routing hot:{}:{}: H (hot experts) must be >= 1", r.hot_count,
                                               r.hot_ratio));
    MOEKIT_CHECK(std::isfinite(r.hot_ratio) && r.hot_ratio > 0,
                 fmt::format("--routing hot:{}:{}: R (how much likelier a hot expert is) must be > 0", r.hot_count,
                             r.hot_ratio));
  }
}

}  // namespace

Routing parse_routing(std::string_view s) {
  Routing r;
  if (s == "uniform") return r;
  if (s.substr(0, 5) == "zipf:") {
    r.kind = Routing::Kind::zipf;
    r.zipf_s = parse_real(s.substr(5), s, "S");
  } else if (s.substr(0, 4) == "hot:") {
    r.kind = Routing::Kind::hot;
    std::string_view rest = s.substr(4);
    size_t colon = rest.find(':');
    MOEKIT_CHECK(colon != std::string_view::npos,
                 fmt::format("--routing '{}': expected hot:H:R (H hot experts, R times as likely)", s));
    std::string_view h = rest.substr(0, colon);
    int count = 0;
    auto [ptr, ec] = std::from_chars(h.data(), h.data() + h.size(), count);
    MOEKIT_CHECK(ec == std::errc() && ptr == h.data() + h.size() && !h.empty(),
                 fmt::format("--routing '{}': H '{}' is not an integer (expected hot:H:R)", s, h));
    r.hot_count = count;
    r.hot_ratio = parse_real(rest.substr(colon + 1), s, "R");
  } else {
    throw Error(fmt::format("--routing '{}' is unknown: expected uniform, zipf:S or hot:H:R", s));
  }
  check_routing(r);
  return r;
}

std::string to_string(const Routing& r) {
  switch (r.kind) {
    case Routing::Kind::zipf: return fmt::format("zipf:{}", r.zipf_s);
    case Routing::Kind::hot: return fmt::format("hot:{}:{}", r.hot_count, r.hot_ratio);
    default: return "uniform";
  }
}

std::vector<double> expert_weights(const Routing& r, int num_experts) {
  check_routing(r);
  MOEKIT_CHECK(num_experts >= 1, fmt::format("experts E = {} must be >= 1", num_experts));
  std::vector<double> w(num_experts, 1.0);
  if (r.kind == Routing::Kind::zipf)
    for (int i = 0; i < num_experts; ++i) w[i] = std::pow(double(i + 1), -r.zipf_s);
  if (r.kind == Routing::Kind::hot) {
    MOEKIT_CHECK(r.hot_count <= num_experts,
                 fmt::format("--routing hot:{}:{}: H = {} hot experts exceeds E = {}", r.hot_count, r.hot_ratio,
                             r.hot_count, num_experts));
    for (int i = 0; i < r.hot_count; ++i) w[i] = r.hot_ratio;
  }
  return w;
}

}  // namespace moekit
