// Routing trace file I/O (see include/moekit/trace.h).
#include "moekit/trace.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "io/file_io.h"
#include "io/json_read.h"
#include "moekit/check.h"
#include "moekit/limits.h"

namespace moekit {

void validate_trace(const RoutingTrace& t) {
  MOEKIT_CHECK(t.num_experts > 0 && t.num_experts <= kMaxExperts,
               fmt::format("trace: num_experts = {} must be in [1, {}]", t.num_experts, kMaxExperts));
  MOEKIT_CHECK(t.topk > 0 && t.topk <= t.num_experts,
               fmt::format("trace: topk = {} must be in [1, num_experts = {}]", t.topk, t.num_experts));
  MOEKIT_CHECK(t.num_ranks > 0 && t.num_ranks <= kMaxRanks,
               fmt::format("trace: num_ranks = {} must be in [1, {}]", t.num_ranks, kMaxRanks));
  MOEKIT_CHECK(t.layers.size() <= size_t(kMaxLayers),
               fmt::format("trace: {} layers exceed the limit of {}", t.layers.size(), kMaxLayers));
  MOEKIT_CHECK(int64_t(t.layers.size()) * t.num_experts <= kMaxTableEntries,
               fmt::format("trace: {} layers x {} experts exceed the limit of {} load entries", t.layers.size(),
                           t.num_experts, kMaxTableEntries));
  // A trace with no step has no loads: every statistic taken from it would be 0 / 0.
  MOEKIT_CHECK(!t.layers.empty(), std::string("trace: holds no layers, expected at least one layer of steps"));
  for (size_t l = 0; l < t.layers.size(); ++l)
    MOEKIT_CHECK(!t.layers[l].empty(), fmt::format("trace: layer {} holds no steps, expected at least one", l));
  // taken[e] == token number + 1 while expert e is in the token's top-k: ids must be distinct.
  std::vector<int64_t> taken(size_t(t.num_experts), 0);
  int64_t token_number = 0;
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
      for (size_t i = 0; i < step.size(); ++i) {
        if (i % t.topk == 0) ++token_number;
        MOEKIT_CHECK(step[i] >= 0 && step[i] < t.num_experts,
                     fmt::format("trace: layer {} step {} token {} expert id {} out of range [0, {})", l, s,
                                 i / t.topk, step[i], t.num_experts));
        MOEKIT_CHECK(taken[step[i]] != token_number,
                     fmt::format("trace: layer {} step {} token {} lists expert id {} twice, expected topk = {} distinct "
                                 "experts",
                                 l, s, i / t.topk, step[i], t.topk));
        taken[step[i]] = token_number;
      }
    }
}

RoutingTrace read_trace(const std::string& path) {
  const std::string origin = fmt::format("trace '{}'", path);
  const nlohmann::json j = parse_json(read_regular_file(path, "trace file"), origin);
  JsonFields f(j, origin);
  const std::string format = f.str("format");
  MOEKIT_CHECK(format == "moekit-trace", fmt::format("{}: field 'format' = \"{}\" must be \"moekit-trace\"", origin,
                                                     quote_text(format)));
  RoutingTrace t;
  t.num_experts = f.integer<int>("num_experts", 1, kMaxExperts);
  t.topk = f.integer<int>("topk", 1, t.num_experts);
  t.num_ranks = f.integer<int>("num_ranks", 1, kMaxRanks);
  const nlohmann::json& layers = f.array("layers", kMaxLayers);
  // The loads of every layer and expert are counted later (trace_loads): bound that table now.
  MOEKIT_CHECK(int64_t(layers.size()) * t.num_experts <= kMaxTableEntries,
               fmt::format("{}: {} layers x {} experts exceed the limit of {} load entries", origin, layers.size(),
                           t.num_experts, kMaxTableEntries));
  auto must_be_array = [&](const nlohmann::json& v, const std::string& where, const char* of) {
    MOEKIT_CHECK(v.is_array(), fmt::format("{}: {} = {} must be an array of {}", origin, where, quote(v), of));
  };
  for (size_t l = 0; l < layers.size(); ++l) {
    must_be_array(layers[l], fmt::format("layer {}", l), "steps");
    auto& steps = t.layers.emplace_back();
    for (size_t s = 0; s < layers[l].size(); ++s) {
      const nlohmann::json& step = layers[l][s];
      must_be_array(step, fmt::format("layer {} step {}", l, s), "tokens");
      auto& flat = steps.emplace_back();
      flat.reserve(step.size() * t.topk);
      for (size_t i = 0; i < step.size(); ++i) {
        const nlohmann::json& token = step[i];
        MOEKIT_CHECK(token.is_array() && token.size() == size_t(t.topk),
                     fmt::format("{}: layer {} step {} token {} = {} must be an array of topk = {} expert ids", origin, l,
                                 s, i, quote(token), t.topk));
        for (const auto& e : token) {
          int64_t id = 0;
          MOEKIT_CHECK(integer_problem(e, 0, t.num_experts - 1, id).empty(),
                       fmt::format("{}: layer {} step {} token {}: expert id {} is not an integer in [0, {})", origin, l,
                                   s, i, quote(e), t.num_experts));
          flat.push_back(int32_t(id));
        }
      }
    }
  }
  try {
    validate_trace(t);
  } catch (const Error& e) {
    std::string_view what = e.what();
    if (what.substr(0, 7) == "trace: ") what.remove_prefix(7);
    throw Error(fmt::format("{}: {}", origin, what));
  }
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
