// Routing trace file I/O (see include/moekit/trace.h).
#include "moekit/trace.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "io/file_io.h"
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
  const std::string text = read_regular_file(path, "trace file");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
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
  OutputFile out(path, "trace file");
  // Written by hand, one token per array, so large traces stay compact and streamable.
  out.write(fmt::format("{{\"format\": \"moekit-trace\", \"num_experts\": {}, \"topk\": {}, \"num_ranks\": {}, \"layers\": [",
                        t.num_experts, t.topk, t.num_ranks));
  std::string buf;
  for (size_t l = 0; l < t.layers.size(); ++l) {
    out.write(l ? ",\n[" : "\n[");
    for (size_t s = 0; s < t.layers[l].size(); ++s) {
      buf = s ? ",\n [" : "\n [";
      const auto& step = t.layers[l][s];
      for (size_t i = 0; i < step.size(); ++i) {
        buf += i % t.topk == 0 ? (i ? "],[" : "[") : ",";
        buf += std::to_string(step[i]);
      }
      buf += step.empty() ? "]" : "]]";
      out.write(buf);
    }
    out.write("]");
  }
  out.write("]}\n");
  out.commit();
}

}  // namespace moekit
