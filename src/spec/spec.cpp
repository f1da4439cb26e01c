// Spec parsing and validation (see include/moekit/spec.h for the contract).
#include "moekit/spec.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "io/file_io.h"
#include "io/json_read.h"
#include "moekit/check.h"
#include "moekit/limits.h"
#include "spec/embedded.h"

namespace moekit {
namespace {

using nlohmann::json;

// The ranges of the floating-point fields (units in include/moekit/spec.h). Wide enough for
// any real model or GPU, narrow enough that no product or quotient of them in the planner
// overflows or divides by a denormal.
constexpr double kMaxParams = 1e15;
constexpr double kMinBytesPerParam = 0.01, kMaxBytesPerParam = 64;
constexpr double kMaxKvBytesPerToken = 1e12;
constexpr double kMinScaling = 1e-6, kMaxScaling = 1e6;
constexpr double kMinHbmBytes = 1e6, kMaxHbmBytes = 1e15;
constexpr double kMinBandwidth = 1e6, kMaxBandwidth = 1e16;  // B/s
constexpr double kMinFlops = 1e6, kMaxFlops = 1e18;          // FLOP/s
constexpr double kMinLatencyUs = 1e-3, kMaxLatencyUs = 1e6;
constexpr size_t kMaxNameBytes = 256;

std::string checked_name(JsonFields& r) {
  std::string name = r.str("name");
  MOEKIT_CHECK(!name.empty(), fmt::format("{}: field 'name' must not be empty", r.origin()));
  MOEKIT_CHECK(name.size() <= kMaxNameBytes, fmt::format("{}: field 'name' = \"{}\" is longer than {} bytes", r.origin(),
                                                         quote_text(name), kMaxNameBytes));
  // The name is printed (moekit plan, spec, run): a control character would reach the terminal
  // raw (ESC starts a terminal command, a newline forges a line of output).
  // C1 controls (U+0080..U+009F, UTF-8 0xC2 0x80..0x9F) too: U+009B is a terminal's CSI.
  for (size_t i = 0; i < name.size(); ++i) {
    const auto c = static_cast<unsigned char>(name[i]);
    const auto next = i + 1 < name.size() ? static_cast<unsigned char>(name[i + 1]) : 0u;
    const bool c1 = c == 0xC2 && next >= 0x80 && next <= 0x9F;
    MOEKIT_CHECK(c >= 0x20 && c != 0x7f && !c1,
                 fmt::format("{}: field 'name' = \"{}\" holds the control character {} at byte {}, expected "
                             "printable text",
                             r.origin(), quote_text(name),
                             c1 ? fmt::format("U+{:04X}", next) : fmt::format("0x{:02X}", unsigned(c)), i));
  }
  return name;
}

RouterSpec parse_router(const json& obj, const std::string& origin, int num_experts, int k) {
  JsonFields r(obj, origin + ".router");
  RouterSpec s;
  s.scoring = r.str("scoring");
  MOEKIT_CHECK(s.scoring == "softmax" || s.scoring == "sigmoid" || s.scoring == "topk_softmax",
               fmt::format("{}: field 'scoring' = \"{}\" must be \"softmax\", \"sigmoid\" or \"topk_softmax\"",
                           r.origin(), quote_text(s.scoring)));
  s.num_groups = r.integer<int>("num_groups", 1, kMaxExperts);
  s.topk_groups = r.integer<int>("topk_groups", 1, kMaxExperts);
  s.routed_scaling_factor = r.number("routed_scaling_factor", kMinScaling, kMaxScaling);
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
  JsonFields r(obj, origin + ".activation");
  ActivationSpec a;
  a.kind = r.str("kind");
  if (a.kind == "clamped_swiglu") {
    a.alpha = r.number("alpha", kMinScaling, kMaxScaling);
    a.limit = r.number("limit", kMinScaling, kMaxScaling);
  } else {
    MOEKIT_CHECK(a.kind == "silu", fmt::format("{}: field 'kind' = \"{}\" must be \"silu\" or \"clamped_swiglu\"",
                                               r.origin(), quote_text(a.kind)));
    for (const char* key : {"alpha", "limit"})
      MOEKIT_CHECK(!r.has(key), fmt::format("{}: field '{}' applies to kind \"clamped_swiglu\" only, not \"silu\"",
                                            r.origin(), key));
  }
  r.reject_unknown();
  return a;
}

// The optional fields of experts that differ from DeepSeek-style ones (spec.h), and what moekit can
// load of them: the FP8 checkpoint layout has no biases and no room for the MXFP4 constraints.
void parse_expert_fields(JsonFields& r, ModelSpec& m) {
  const std::string& origin = r.origin();
  if (r.has("expert_format")) m.expert_format = r.str("expert_format");
  MOEKIT_CHECK(m.expert_format == "fp8" || m.expert_format == "mxfp4",
               fmt::format("{}: field 'expert_format' = \"{}\" must be \"fp8\" or \"mxfp4\"", origin,
                           quote_text(m.expert_format)));
  if (r.has("activation")) m.activation = parse_activation(r.object("activation"), origin);
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
  JsonFields r(obj, std::string(origin));
  ModelSpec m;
  m.name = checked_name(r);
  m.hidden_size = r.integer<int64_t>("hidden_size", 1, kMaxHiddenSize);
  m.num_layers = r.integer<int>("num_layers", 1, kMaxLayers);
  m.num_moe_layers = r.integer<int>("num_moe_layers", 0, kMaxLayers);
  m.moe_intermediate_size = r.integer<int64_t>("moe_intermediate_size", 0, kMaxHiddenSize);
  m.num_routed_experts = r.integer<int>("num_routed_experts", 0, kMaxExperts);
  m.num_experts_per_token = r.integer<int>("num_experts_per_token", 0, kMaxExperts);
  m.num_shared_experts = r.integer<int>("num_shared_experts", 0, kMaxExperts);
  m.shared_intermediate_size = r.integer<int64_t>("shared_intermediate_size", 0, kMaxHiddenSize);
  m.total_params = r.number("total_params", 1, kMaxParams);
  m.active_params = r.number("active_params", 1, kMaxParams);
  m.weight_bytes_per_param = r.number("weight_bytes_per_param", kMinBytesPerParam, kMaxBytesPerParam);
  m.kv_bytes_per_token = r.number("kv_bytes_per_token", 1, kMaxKvBytesPerToken);

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
    MOEKIT_CHECK(!r.has("router"), fmt::format("{}: a dense model (num_routed_experts = 0) has no router; field "
                                               "'router' given", origin));
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
    m.router = parse_router(r.at("router"), std::string(origin), m.num_routed_experts, m.num_experts_per_token);
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
  JsonFields r(obj, std::string(origin));
  GpuSpec g;
  g.name = checked_name(r);
  g.hbm_bytes = r.number("hbm_bytes", kMinHbmBytes, kMaxHbmBytes);
  g.hbm_bandwidth = r.number("hbm_bandwidth", kMinBandwidth, kMaxBandwidth);
  g.fp8_flops = r.number("fp8_flops", kMinFlops, kMaxFlops);
  g.bf16_flops = r.number("bf16_flops", kMinFlops, kMaxFlops);
  g.nvlink_bandwidth = r.number("nvlink_bandwidth", kMinBandwidth, kMaxBandwidth);
  g.nvlink_latency_us = r.number("nvlink_latency_us", kMinLatencyUs, kMaxLatencyUs);
  g.network_bandwidth = r.number("network_bandwidth", kMinBandwidth, kMaxBandwidth);
  g.network_latency_us = r.number("network_latency_us", kMinLatencyUs, kMaxLatencyUs);
  g.gpus_per_node = r.integer<int>("gpus_per_node", 1, kMaxRanks);
  r.reject_unknown();
  return g;
}

namespace {

bool looks_like_path(std::string_view s) {
  return s.find('/') != std::string_view::npos || (s.size() > 5 && s.substr(s.size() - 5) == ".json");
}

std::string read_file(std::string_view path) { return read_regular_file(std::string(path), "spec file"); }

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
