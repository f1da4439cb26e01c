// Routing distributions of the simulator: parsing "uniform", "zipf:S", "hot:H:R",
// "drift:H:R:PERIOD" and the weight of each expert (see include/moekit/simulate.h).
#include <fmt/format.h>

#include <algorithm>
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
               fmt::format("--routing '{}': {} '{}' is not a number (expected uniform, zipf:S or hot:H:R, "
                           "or drift:H:R:PERIOD)", whole, what, text));
  return v;
}

template <class Int>
Int parse_integer(std::string_view text, std::string_view whole, const char* what, const char* form) {
  Int v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  MOEKIT_CHECK(ec == std::errc() && ptr == text.data() + text.size() && !text.empty(),
               fmt::format("--routing '{}': {} '{}' is not an integer (expected {})", whole, what, text, form));
  return v;
}

void check_routing(const Routing& r) {
  if (r.kind == Routing::Kind::zipf)
    MOEKIT_CHECK(std::isfinite(r.zipf_s) && r.zipf_s >= 0,
                 fmt::format("--routing zipf:{}: the exponent S must be >= 0", r.zipf_s));
  if (r.kind == Routing::Kind::hot || r.kind == Routing::Kind::drift) {
    MOEKIT_CHECK(r.hot_count >= 1, fmt::format("--routing {}: H (hot experts) must be >= 1", to_string(r)));
    MOEKIT_CHECK(std::isfinite(r.hot_ratio) && r.hot_ratio > 0,
                 fmt::format("--routing {}: R (how much likelier a hot expert is) must be > 0", to_string(r)));
  }
  if (r.kind == Routing::Kind::drift)
    MOEKIT_CHECK(r.drift_period >= 1,
                 fmt::format("--routing {}: PERIOD (steps between two drifts) must be >= 1", to_string(r)));
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
    r.hot_count = parse_integer<int>(rest.substr(0, colon), s, "H", "hot:H:R");
    r.hot_ratio = parse_real(rest.substr(colon + 1), s, "R");
  } else if (s.substr(0, 6) == "drift:") {
    r.kind = Routing::Kind::drift;
    std::string_view rest = s.substr(6);
    const size_t first = rest.find(':'), second = first == std::string_view::npos ? first : rest.find(':', first + 1);
    MOEKIT_CHECK(second != std::string_view::npos,
                 fmt::format("--routing '{}': expected drift:H:R:PERIOD (H hot experts, R times as likely, moving on "
                             "every PERIOD steps)", s));
    r.hot_count = parse_integer<int>(rest.substr(0, first), s, "H", "drift:H:R:PERIOD");
    r.hot_ratio = parse_real(rest.substr(first + 1, second - first - 1), s, "R");
    r.drift_period = parse_integer<int64_t>(rest.substr(second + 1), s, "PERIOD", "drift:H:R:PERIOD");
  } else {
    throw Error(fmt::format("--routing '{}' is unknown: expected uniform, zipf:S or hot:H:R, or drift:H:R:PERIOD "
                            "for hot experts that move", s));
  }
  check_routing(r);
  return r;
}

std::string to_string(const Routing& r) {
  switch (r.kind) {
    case Routing::Kind::zipf: return fmt::format("zipf:{}", r.zipf_s);
    case Routing::Kind::hot: return fmt::format("hot:{}:{}", r.hot_count, r.hot_ratio);
    case Routing::Kind::drift: return fmt::format("drift:{}:{}:{}", r.hot_count, r.hot_ratio, r.drift_period);
    default: return "uniform";
  }
}

namespace {
// What both weight functions check: the routing, E, and no more hot experts than E.
bool check_weights_request(const Routing& r, int num_experts) {
  check_routing(r);
  MOEKIT_CHECK(num_experts >= 1, fmt::format("experts E = {} must be >= 1", num_experts));
  const bool hot = r.kind == Routing::Kind::hot || r.kind == Routing::Kind::drift;
  MOEKIT_CHECK(!hot || r.hot_count <= num_experts,
               fmt::format("--routing {}: H = {} hot experts exceeds E = {}", to_string(r), r.hot_count, num_experts));
  return hot;
}
}  // namespace

std::vector<double> expert_weights(const Routing& r, int num_experts) {
  const bool hot = check_weights_request(r, num_experts);
  std::vector<double> w(num_experts, 1.0);
  if (r.kind == Routing::Kind::zipf)
    for (int i = 0; i < num_experts; ++i) w[i] = std::pow(double(i + 1), -r.zipf_s);
  if (hot)
    for (int i = 0; i < r.hot_count; ++i) w[i] = r.hot_ratio;
  // Scaled by a power of two so that the largest is in [1, 2): exact, so every ratio stays what
  // it was, and no sum of them overflows (8 weights of hot:8:1e308 sum to inf unscaled).
  const int scale = std::ilogb(*std::max_element(w.begin(), w.end()));
  for (double& x : w) x = std::ldexp(x, -scale);
  return w;
}

std::vector<double> expert_log_weights(const Routing& r, int num_experts) {
  const bool hot = check_weights_request(r, num_experts);
  std::vector<double> lw(num_experts, 0.0);
  if (r.kind == Routing::Kind::zipf)
    for (int i = 0; i < num_experts; ++i) lw[i] = -r.zipf_s * std::log(double(i + 1));
  if (hot)
    for (int i = 0; i < r.hot_count; ++i) lw[i] = std::log(r.hot_ratio);
  return lw;
}

int routing_shift(const Routing& r, int num_experts, int64_t step) {
  MOEKIT_CHECK(num_experts >= 1 && step >= 0,
               fmt::format("routing_shift: E = {} and step = {}, expected >= 1 and >= 0", num_experts, step));
  if (r.kind != Routing::Kind::drift) return 0;
  check_routing(r);
  return int((step / r.drift_period) % num_experts * r.hot_count % num_experts);
}

std::vector<double> expert_weights_at(const Routing& r, int num_experts, int64_t step) {
  const std::vector<double> first = expert_weights(r, num_experts);
  const int shift = routing_shift(r, num_experts, step);
  std::vector<double> w(num_experts);
  for (int e = 0; e < num_experts; ++e) w[(e + shift) % num_experts] = first[e];
  return w;
}

}  // namespace moekit
