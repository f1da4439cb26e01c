// Spec parsing and validation (see include/moekit/spec.h for the contract).
#include "moekit/spec.h"

#include <fmt/format.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "moekit/check.h"
#include "spec/embedded.h"

namespace moekit {
namespace {

using nlohmann::json;

// Reads typed fields out of one JSON object and remembers which keys were used, so that
// unknown keys (usually typos) can be rejected at the end.
class FieldReader {
 public:
  FieldReader(const json& obj, std::string origin) : obj_(obj), origin_(std::move(origin)) {
    MOEKIT_CHECK(obj_.is_object(), fmt::format("{}: expected a JSON object, got {}", origin_, obj_.type_name()));
  }

  const json& field(const std::string& key) {
    seen_.insert(key);
    MOEKIT_CHECK(obj_.contains(key), fmt::format("{}: missing field '{}'", origin_, key));
    return obj_.at(key);
  }
  bool has(const std::string& key) const { return obj_.contains(key); }

  std::string str(const std::string& key) {
    const json& v = field(key);
    MOEKIT_CHECK(v.is_string(), fmt::format("{}: field '{}' = {} must be a string", origin_, key, v.dump()));
    return v.get<std::string>();
  }
  double number(const std::string& key) {
    const json& v = field(key);
    MOEKIT_CHECK(v.is_number(), fmt::format("{}: field '{}' = {} must be a number", origin_, key, v.dump()));
    return v.get<double>();
  }
  double positive(const std::string& key) {
    double v = number(key);
    MOEKIT_CHECK(v > 0, fmt::format("{}: field '{}' = {} must be > 0", origin_, key, v));
    return v;
  }
  int64_t integer(const std::string& key, int64_t min_value) {
    const json& v = field(key);
    MOEKIT_CHECK(v.is_number_integer(), fmt::format("{}: field '{}' = {} must be an integer", origin_, key, v.dump()));
    int64_t x = v.get<int64_t>();
    MOEKIT_CHECK(x >= min_value, fmt::format("{}: field '{}' = {} must be >= {}", origin_, key, x, min_value));
    return x;
  }
  bool boolean(const std::string& key) {
    const json& v = field(key);
    MOEKIT_CHECK(v.is_boolean(), fmt::format("{}: field '{}' = {} must be true or false", origin_, key, v.dump()));
    return v.get<bool>();
  }
  // Free-text keys that carry provenance ("notes", "source") are allowed and ignored.
  void reject_unknown() const {
    for (const auto& [key, value] : obj_.items()) {
      if (key == "notes" || key == "source") continue;
      MOEKIT_CHECK(seen_.count(key), fmt::format("{}: unknown field '{}' (a typo?)", origin_, key));
    }
  }
  const std::string& origin() const { return origin_; }

 private:
  const json& obj_;
  std::string origin_;
  std::set<std::string> seen_;
};

json parse_json(std::string_view text, std::string_view origin) {
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    throw Error(fmt::format("{}: malformed JSON: {}", origin, e.what()));
  }
}

RouterSpec parse_router(const json& obj, const std::string& origin, int num_experts, int k) {
  FieldReader r(obj, origin + ".router");
  RouterSpec s;
  s.scoring = r.str("scoring");
  MOEKIT_CHECK(s.scoring == "softmax" || s.scoring == "sigmoid" || s.scoring == "topk_softmax",
               fmt::format("{}: field 'scoring' = \"{}\" must be \"softmax\", \"sigmoid\" or \"topk_softmax\"",
                           r.origin(), s.scoring));
  s.num_groups = int(r.integer("num_groups", 1));
  s.topk_groups = int(r.integer("topk_groups", 1));
  s.routed_scaling_factor = r.positive("routed_scaling_factor");
  s.normalize_topk = r.boolean("normalize_topk");
  if (r.has("logit_bias")) s.logit_bias = r.boolean("logit_bias");
  r.reject_unknown();
  if (s.scoring == "topk_softmax") {
    MOEKIT_CHECK(s.num_groups == 1, fmt::format("{}: scoring \"topk_softmax\" picks the k largest logits of all experts: "
                                                "num_groups = {} must be 1", r.origin(), s.num_groups));
    MOEKIT_CHECK(s.normalize_topk, fmt::format("{}: scoring \"topk_softmax\" is a softmax over the k chosen logits, "
                                               "which sums to 1: normalize_topk must be true", r.origin()));
  }
  MOEKIT_CHECK(num_experts % s.num_groups == 0,
               fmt::format("{}: num_groups = {} must divide num_routed_experts = {}", r.origin(), s.num_groups, num_experts));
  MOEKIT_CHECK(s.topk_groups <= s.num_groups,
               fmt::format("{}: topk_groups = {} must be <= num_groups = {}", r.origin(), s.topk_groups, s.num_groups));
  MOEKIT_CHECK(int64_t(s.topk_groups) * (num_experts / s.num_groups) >= k,
               fmt::format("{}: topk_groups = {} groups of {} experts cannot hold k = {} experts", r.origin(),
                           s.topk_groups, num_experts / s.num_groups, k));
  return s;
}

ActivationSpec parse_activation(const json& obj, const std::string& origin) {
  FieldReader r(obj, origin + ".activation");
  ActivationSpec a;
  a.kind = r.str("kind");
  if (a.kind == "clamped_swiglu") {
    a.alpha = r.positive("alpha");
    a.limit = r.positive("limit");
    for (auto [key, v] : {std::pair{"alpha", a.alpha}, {"limit", a.limit}})
      MOEKIT_CHECK(std::isfinite(v), fmt::format("{}: field '{}' = {} must be finite", r.origin(), key, v));
  } else {
    MOEKIT_CHECK(a.kind == "silu", fmt::format("{}: field 'kind' = \"{}\" must be \"silu\" or \"clamped_swiglu\"",
                                               r.origin(), a.kind));
    for (const char* key : {"alpha", "limit"})
      MOEKIT_CHECK(!r.has(key), fmt::format("{}: field '{}' applies to kind \"clamped_swiglu\" only, not \"silu\"",
                                            r.origin(), key));
  }
  r.reject_unknown();
  return a;
}

// The optional fields of experts that differ from DeepSeek-style ones (spec.h), and what moekit can
// load of them: the FP8 checkpoint layout has no biases and no room for the MXFP4 constraints.
void parse_expert_fields(FieldReader& r, ModelSpec& m) {
  const std::string& origin = r.origin();
  if (r.has("expert_format")) m.expert_format = r.str("expert_format");
  MOEKIT_CHECK(m.expert_format == "fp8" || m.expert_format == "mxfp4",
               fmt::format("{}: field 'expert_format' = \"{}\" must be \"fp8\" or \"mxfp4\"", origin, m.expert_format));
  if (r.has("activation")) m.activation = parse_activation(r.field("activation"), origin);
  if (r.has("expert_bias")) m.expert_bias = r.boolean("expert_bias");
  const bool mxfp4 = m.expert_format == "mxfp4";
  MOEKIT_CHECK(!m.expert_bias || mxfp4,
               fmt::format("{}: expert_bias = true needs expert_format \"mxfp4\": the FP8 (DeepSeek-V3) checkpoint "
                           "layout has no expert biases", origin));
  MOEKIT_CHECK(!m.router.logit_bias || mxfp4,
               fmt::format("{}: router logit_bias = true needs expert_format \"mxfp4\": the FP8 (DeepSeek-V3) "
                           "checkpoint layout has no router bias (its sigmoid routers' e_score_correction_bias "
                           "steers the selection only)", origin));
  if (!mxfp4) return;
  MOEKIT_CHECK(m.num_shared_experts == 0,
               fmt::format("{}: expert_format \"mxfp4\" (the gpt-oss layout) has no shared experts, got "
                           "num_shared_experts = {}", origin, m.num_shared_experts));
  for (auto [key, v] : {std::pair{"hidden_size", m.hidden_size}, {"moe_intermediate_size", m.moe_intermediate_size}})
    MOEKIT_CHECK(v % 32 == 0, fmt::format("{}: {} = {} must be a multiple of 32 with expert_format \"mxfp4\" (one "
                                          "e8m0 scale per 32 values along K)", origin, key, v));
}

}  // namespace

ModelSpec parse_model_spec(std::string_view json_text, std::string_view origin) {
  json obj = parse_json(json_text, origin);
  FieldReader r(obj, std::string(origin));
  ModelSpec m;
  m.name = r.str("name");
  MOEKIT_CHECK(!m.name.empty(), fmt::format("{}: field 'name' must not be empty", origin));
  m.hidden_size = r.integer("hidden_size", 1);
  m.num_layers = int(r.integer("num_layers", 1));
  m.num_moe_layers = int(r.integer("num_moe_layers", 0));
  m.moe_intermediate_size = r.integer("moe_intermediate_size", 0);
  m.num_routed_experts = int(r.integer("num_routed_experts", 0));
  m.num_experts_per_token = int(r.integer("num_experts_per_token", 0));
  m.num_shared_experts = int(r.integer("num_shared_experts", 0));
  m.shared_intermediate_size = r.integer("shared_intermediate_size", 0);
  m.total_params = r.positive("total_params");
  m.active_params = r.positive("active_params");
  m.weight_bytes_per_param = r.positive("weight_bytes_per_param");
  m.kv_bytes_per_token = r.positive("kv_bytes_per_token");

  MOEKIT_CHECK(m.num_moe_layers <= m.num_layers,
               fmt::format("{}: num_moe_layers = {} must be <= num_layers = {}", origin, m.num_moe_layers, m.num_layers));
  MOEKIT_CHECK(m.active_params <= m.total_params,
               fmt::format("{}: active_params = {} must be <= total_params = {}", origin, m.active_params, m.total_params));
  if (m.num_routed_experts == 0) {
    // Dense model: every MoE field must be zero and there is no router.
    MOEKIT_CHECK(m.num_experts_per_token == 0 && m.num_moe_layers == 0 && m.moe_intermediate_size == 0,
                 fmt::format("{}: a dense model (num_routed_experts = 0) needs num_experts_per_token, num_moe_layers "
                             "and moe_intermediate_size = 0, got {}, {}, {}",
                             origin, m.num_experts_per_token, m.num_moe_layers, m.moe_intermediate_size));
    if (r.has("router")) r.field("router");
  } else {
    MOEKIT_CHECK(m.num_experts_per_token >= 1,
                 fmt::format("{}: num_experts_per_token = {} must be >= 1", origin, m.num_experts_per_token));
    MOEKIT_CHECK(m.num_experts_per_token <= m.num_routed_experts,
                 fmt::format("{}: num_experts_per_token (k) = {} must be <= num_routed_experts (E) = {}", origin,
                             m.num_experts_per_token, m.num_routed_experts));
    MOEKIT_CHECK(m.num_moe_layers >= 1, fmt::format("{}: num_moe_layers = {} must be >= 1 for an MoE model", origin,
                                                    m.num_moe_layers));
    MOEKIT_CHECK(m.moe_intermediate_size >= 1,
                 fmt::format("{}: moe_intermediate_size = {} must be >= 1", origin, m.moe_intermediate_size));
    m.router = parse_router(r.field("router"), std::string(origin), m.num_routed_experts, m.num_experts_per_token);
    double routed = double(m.num_moe_layers) * m.num_routed_experts * m.params_per_expert();
    MOEKIT_CHECK(routed <= m.total_params,
                 fmt::format("{}: routed expert parameters {:.4g} (num_moe_layers x E x 3 x hidden x inter) exceed "
                             "total_params = {:.4g}",
                             origin, routed, m.total_params));
  }
  MOEKIT_CHECK((m.num_shared_experts == 0) == (m.shared_intermediate_size == 0),
               fmt::format("{}: num_shared_experts = {} and shared_intermediate_size = {} must be both 0 or both > 0",
                           origin, m.num_shared_experts, m.shared_intermediate_size));
  parse_expert_fields(r, m);
  r.reject_unknown();
  return m;
}

GpuSpec parse_gpu_spec(std::string_view json_text, std::string_view origin) {
  json obj = parse_json(json_text, origin);
  FieldReader r(obj, std::string(origin));
  GpuSpec g;
  g.name = r.str("name");
  MOEKIT_CHECK(!g.name.empty(), fmt::format("{}: field 'name' must not be empty", origin));
  g.hbm_bytes = r.positive("hbm_bytes");
  g.hbm_bandwidth = r.positive("hbm_bandwidth");
  g.fp8_flops = r.positive("fp8_flops");
  g.bf16_flops = r.positive("bf16_flops");
  g.nvlink_bandwidth = r.positive("nvlink_bandwidth");
  g.nvlink_latency_us = r.positive("nvlink_latency_us");
  g.network_bandwidth = r.positive("network_bandwidth");
  g.network_latency_us = r.positive("network_latency_us");
  g.gpus_per_node = int(r.integer("gpus_per_node", 1));
  r.reject_unknown();
  return g;
}

namespace {

bool looks_like_path(std::string_view s) {
  return s.find('/') != std::string_view::npos || (s.size() > 5 && s.substr(s.size() - 5) == ".json");
}

std::string read_file(std::string_view path) {
  std::ifstream in{std::string(path)};
  MOEKIT_CHECK(in.good(), fmt::format("cannot open spec file '{}'", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string_view find_embedded(const std::vector<detail::EmbeddedSpec>& specs, std::string_view name,
                               const char* kind) {
  std::string known;
  for (const auto& s : specs) {
    if (s.name == name) return s.json;
    known += (known.empty() ? "" : ", ") + std::string(s.name);
  }
  throw Error(fmt::format("unknown {} '{}': expected a path to a JSON file or one of: {}", kind, name, known));
}

}  // namespace

ModelSpec load_model_spec(std::string_view name_or_path) {
  if (looks_like_path(name_or_path)) return parse_model_spec(read_file(name_or_path), name_or_path);
  return parse_model_spec(find_embedded(detail::embedded_models(), name_or_path, "model"),
                          "embedded:" + std::string(name_or_path));
}

GpuSpec load_gpu_spec(std::string_view name_or_path) {
  if (looks_like_path(name_or_path)) return parse_gpu_spec(read_file(name_or_path), name_or_path);
  return parse_gpu_spec(find_embedded(detail::embedded_gpus(), name_or_path, "GPU"),
                        "embedded:" + std::string(name_or_path));
}

std::vector<std::string> embedded_model_names() {
  std::vector<std::string> names;
  for (const auto& s : detail::embedded_models()) names.emplace_back(s.name);
  return names;
}

std::vector<std::string> embedded_gpu_names() {
  std::vector<std::string> names;
  for (const auto& s : detail::embedded_gpus()) names.emplace_back(s.name);
  return names;
}

std::string to_json(const ModelSpec& m) {
  nlohmann::ordered_json j = {{"name", m.name},
            {"hidden_size", m.hidden_size},
            {"num_layers", m.num_layers},
            {"num_moe_layers", m.num_moe_layers},
            {"moe_intermediate_size", m.moe_intermediate_size},
            {"num_routed_experts", m.num_routed_experts},
            {"num_experts_per_token", m.num_experts_per_token},
            {"num_shared_experts", m.num_shared_experts},
            {"shared_intermediate_size", m.shared_intermediate_size},
            {"total_params", m.total_params},
            {"active_params", m.active_params},
            {"weight_bytes_per_param", m.weight_bytes_per_param},
            {"kv_bytes_per_token", m.kv_bytes_per_token}};
  if (m.is_moe())
    j["router"] = {{"scoring", m.router.scoring},
                   {"num_groups", m.router.num_groups},
                   {"topk_groups", m.router.topk_groups},
                   {"routed_scaling_factor", m.router.routed_scaling_factor},
                   {"normalize_topk", m.router.normalize_topk}};
  // The optional expert fields, only where they differ from the default (spec.h).
  if (m.is_moe() && m.router.logit_bias) j["router"]["logit_bias"] = true;
  if (m.expert_format != "fp8") j["expert_format"] = m.expert_format;
  if (m.activation.kind != "silu")
    j["activation"] = {{"kind", m.activation.kind}, {"alpha", m.activation.alpha}, {"limit", m.activation.limit}};
  if (m.expert_bias) j["expert_bias"] = true;
  return j.dump(2);
}

std::string to_json(const GpuSpec& g) {
  nlohmann::ordered_json j = {{"name", g.name},
            {"hbm_bytes", g.hbm_bytes},
            {"hbm_bandwidth", g.hbm_bandwidth},
            {"fp8_flops", g.fp8_flops},
            {"bf16_flops", g.bf16_flops},
            {"nvlink_bandwidth", g.nvlink_bandwidth},
            {"nvlink_latency_us", g.nvlink_latency_us},
            {"network_bandwidth", g.network_bandwidth},
            {"network_latency_us", g.network_latency_us},
            {"gpus_per_node", g.gpus_per_node}};
  return j.dump(2);
}

}  // namespace moekit
