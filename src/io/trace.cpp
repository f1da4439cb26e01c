// Routing trace file I/O (see include/moekit/trace.h).
#include "moekit/trace.h"

#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "moekit/check.h"

namespace moekit {

void validate_trace(const RoutingTrace& t) {
  MOEKIT_CHECK(t.num_experts > 0, fmt::format("trace: num_experts = {} must be > 0", t.num_experts));
  MOEKIT_CHECK(t.topk > 0 && t.topk <= t.num_experts,
               fmt::format("trace: topk = {} must be in [1, num_experts = {}]", t.topk, t.num_experts));
  MOEKIT_CHECK(t.num_ranks > 0, fmt::format("trace: num_ranks = {} must be > 0", t.num_ranks));
  for (size_t l = 0; l < t.layers.size(); ++l)
    for (size_t s = 0; s < t.layers[l].size(); ++s) {
      const auto& step = t.layers[l][s];
      MOEKIT_CHECK(step.size() % t.topk == 0,
                   fmt::format("trace: layer {} step {} holds {} indices, not a multiple of topk = {}", l, s,
                               step.size(), t.topk));
      size_t tokens = step.size() / t.topk;
      MOEKIT_CHECK(tokens % t.num_ranks == 0,
                   fmt::format("trace: layer {} step {} has {} tokens, not a multiple of num_ranks = {}", l, s, tokens,
                               t.num_ranks));
      for (size_t i = 0; i < step.size(); ++i)
        MOEKIT_CHECK(step[i] >= 0 && step[i] < t.num_experts,
                     fmt::format("trace: layer {} step {} token {} expert id {} out of range [0, {})", l, s,
                                 i / t.topk, step[i], t.num_experts));
    }
}

RoutingTrace read_trace(const std::string& path) {
  std::ifstream in(path);
  MOEKIT_CHECK(in.good(), fmt::format("cannot open trace file '{}'", path));
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("trace '{}': malformed JSON: {}", path, e.what()));
  }
  MOEKIT_CHECK(j.is_object() && j.value("format", "") == "moekit-trace",
               fmt::format("trace '{}': expected an object with \"format\": \"moekit-trace\"", path));
  RoutingTrace t;
  try {
    t.num_experts = j.at("num_experts").get<int>();
    t.topk = j.at("topk").get<int>();
    t.num_ranks = j.at("num_ranks").get<int>();
    for (const auto& layer : j.at("layers")) {
      auto& steps = t.layers.emplace_back();
      for (const auto& step : layer) {
        auto& flat = steps.emplace_back();
        for (const auto& token : step) {
          MOEKIT_CHECK(token.is_array() && int(token.size()) == t.topk,
                       fmt::format("trace '{}': token entry {} must be an array of topk = {} ids", path, token.dump(),
                                   t.topk));
          for (const auto& e : token) flat.push_back(e.get<int32_t>());
        }
      }
    }
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("trace '{}': {}", path, e.what()));
  }
  validate_trace(t);
  return t;
}

void write_trace(const RoutingTrace& t, const std::string& path) {
  validate_trace(t);
  std::ofstream out(path);
  MOEKIT_CHECK(out.good(), fmt::format("cannot write trace file '{}'", path));
  // Written by hand, one token per array, so large traces stay compact and streamable.
  out << "{\"format\": \"moekit-trace\", \"num_experts\": " << t.num_experts << ", \"topk\": " << t.topk
      << ", \"num_ranks\": " << t.num_ranks << ", \"layers\": [";
  for (size_t l = 0; l < t.layers.size(); ++l) {
    out << (l ? ",\n[" : "\n[");
    for (size_t s = 0; s < t.layers[l].size(); ++s) {
      out << (s ? ",\n [" : "\n [");
      const auto& step = t.layers[l][s];
      for (size_t i = 0; i < step.size(); ++i) {
        if (i % t.topk == 0) out << (i ? "],[" : "[");
        else out << ",";
        out << step[i];
      }
      out << (step.empty() ? "]" : "]]");
    }
    out << "]";
  }
  out << "]}\n";
  MOEKIT_CHECK(out.good(), fmt::format("writing trace file '{}' failed", path));
}

}  // namespace moekit
