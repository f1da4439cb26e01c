// Spec validation: every embedded spec loads; each kind of bad spec is an Error naming the field.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <tuple>

#include "expect_error.h"
#include "moekit/check.h"
#include "moekit/spec.h"

using namespace moekit;
using nlohmann::json;

namespace {

json deepseek() { return json::parse(to_json(load_model_spec("deepseek-v3"))); }
json h200() { return json::parse(to_json(load_gpu_spec("h200"))); }

}  // namespace

TEST(Spec, EveryEmbeddedSpecLoads) {
  auto models = embedded_model_names();
  for (const char* want : {"llama-3-70b", "deepseek-v3", "kimi-k2", "qwen3-235b-a22b", "qwen3.5-397b-a17b", "glm-4.5",
                           "gpt-oss-120b", "gpt-oss-20b", "mixtral-8x7b", "tiny-moe"})
    EXPECT_NE(std::find(models.begin(), models.end(), want), models.end()) << want;
  for (const auto& name : models) EXPECT_EQ(load_model_spec(name).name, name);
  auto gpus = embedded_gpu_names();
  for (const char* want : {"h100-sxm", "h200", "h20", "h800", "b200"})
    EXPECT_NE(std::find(gpus.begin(), gpus.end(), want), gpus.end()) << want;
  for (const auto& name : gpus) EXPECT_EQ(load_gpu_spec(name).name, name);
}

TEST(Spec, DeepSeekFigures) {
  ModelSpec m = load_model_spec("deepseek-v3");
  EXPECT_EQ(m.hidden_size, 7168);
  EXPECT_EQ(m.num_routed_experts, 256);
  EXPECT_EQ(m.num_experts_per_token, 8);
  EXPECT_EQ(m.num_moe_layers, 58);
  EXPECT_EQ(m.router.scoring, "sigmoid");
  EXPECT_EQ(m.router.num_groups, 8);
  EXPECT_EQ(m.router.topk_groups, 4);
  EXPECT_DOUBLE_EQ(m.router.routed_scaling_factor, 2.5);
  EXPECT_NEAR(m.params_per_expert(), 44.04e6, 0.01e6);  // 3 · 7168 · 2048 = 44.04M per expert
  EXPECT_FALSE(load_model_spec("llama-3-70b").is_moe());
}

// A dense model has no router: a "router" field is refused, not read and dropped.
TEST(Spec, DenseModelWithRouterIsAnError) {
  json j = json::parse(to_json(load_model_spec("llama-3-70b")));
  ASSERT_FALSE(j.contains("router"));
  EXPECT_NO_THROW(parse_model_spec(j.dump(), "t"));
  j["router"] = {{"scoring", "nonsense"}};
  expect_error([&] { parse_model_spec(j.dump(), "t"); }, {"t: a dense model", "'router' given"});
}

TEST(Spec, RoundTripThroughJson) {
  ModelSpec a = load_model_spec("qwen3.5-397b-a17b");
  ModelSpec b = parse_model_spec(to_json(a), "roundtrip");
  EXPECT_EQ(to_json(a), to_json(b));
  GpuSpec g = load_gpu_spec("h20");
  EXPECT_EQ(to_json(g), to_json(parse_gpu_spec(to_json(g), "roundtrip")));
}

TEST(Spec, RejectsMissingField) {
  json j = deepseek();
  j.erase("hidden_size");
  expect_error([&] { parse_model_spec(j.dump(), "t"); }, {"missing field 'hidden_size'"});
  json g = h200();
  g.erase("hbm_bandwidth");
  expect_error([&] { parse_gpu_spec(g.dump(), "t"); }, {"missing field 'hbm_bandwidth'"});
  json r = deepseek();
  r["router"].erase("scoring");
  expect_error([&] { parse_model_spec(r.dump(), "t"); }, {"t.router", "missing field 'scoring'"});
}

TEST(Spec, RejectsWrongType) {
  json j = deepseek();
  j["hidden_size"] = "7168";
  expect_error([&] { parse_model_spec(j.dump(), "t"); }, {"'hidden_size'", "\"7168\"", "integer"});
  j = deepseek();
  j["num_routed_experts"] = 2.5;
  expect_error([&] { parse_model_spec(j.dump(), "t"); }, {"'num_routed_experts'", "2.5", "integer"});
  json g = h200();
  g["fp8_flops"] = true;
  expect_error([&] { parse_gpu_spec(g.dump(), "t"); }, {"'fp8_flops'", "true", "number"});
}

TEST(Spec, RejectsNonPositiveSizes) {
  json j = deepseek();
  j["hidden_size"] = 0;
  expect_error([&] { parse_model_spec(j.dump(), "t"); }, {"'hidden_size' = 0", ">= 1"});
  j = deepseek();
  j["weight_bytes_per_param"] = -1;
  expect_error([&] { parse_model_spec(j.dump(), "t"); }, {"'weight_bytes_per_param' = -1", "> 0"});
  json g = h200();
  g["hbm_bandwidth"] = 0;
  expect_error([&] { parse_gpu_spec(g.dump(), "t"); }, {"'hbm_bandwidth' = 0", "> 0"});
}

TEST(Spec, RejectsKGreaterThanE) {
  json j = deepseek();
  j["num_experts_per_token"] = 300;
  expect_error([&] { parse_model_spec(j.dump(), "t"); }, {"num_experts_per_token (k) = 300", "num_routed_experts (E) = 256"});
}

TEST(Spec, RejectsUnknownNamesAndKeys) {
  expect_error([] { load_model_spec("deepseek-v9"); }, {"unknown model 'deepseek-v9'", "deepseek-v3"});
  expect_error([] { load_gpu_spec("a100"); }, {"unknown GPU 'a100'", "h200"});
  json j = deepseek();
  j["hiden_size"] = 1;
  expect_error([&] { parse_model_spec(j.dump(), "t"); }, {"unknown field 'hiden_size'"});
  j = deepseek();
  j["router"]["scoring"] = "relu";
  expect_error([&] { parse_model_spec(j.dump(), "t"); }, {"'scoring' = \"relu\"", "softmax"});
}

TEST(Spec, RejectsInconsistentRouterAndMalformedJson) {
  json j = deepseek();
  j["router"]["num_groups"] = 7;
  expect_error([&] { parse_model_spec(j.dump(), "t"); }, {"num_groups = 7", "num_routed_experts = 256"});
  j = deepseek();
  j["router"]["topk_groups"] = 9;
  expect_error([&] { parse_model_spec(j.dump(), "t"); }, {"topk_groups = 9"});
  expect_error([] { parse_model_spec("{\"name\": ", "broken.json"); }, {"broken.json", "malformed JSON"});
  expect_error([] { load_model_spec("/nonexistent/model.json"); }, {"cannot open spec file '/nonexistent/model.json'"});
}

TEST(Spec, EveryNumberHasARange) {
  // Counts in the int they are stored in; floats within ranges that keep the planner finite.
  json j = deepseek();
  j["hidden_size"] = 1 << 21;
  expect_error([&] { parse_model_spec(j.dump(), "t"); }, {"'hidden_size' = 2097152 must be <= 1048576"});
  j = deepseek();
  j["total_params"] = 1e300;
  expect_error([&] { parse_model_spec(j.dump(), "t"); }, {"'total_params' = 1e+300 must be <= 1e+15"});
  json g = h200();
  g["network_latency_us"] = 1e-320;
  expect_error([&] { parse_gpu_spec(g.dump(), "t"); }, {"'network_latency_us' = 1e-320 must be >= 0.001"});
  g = h200();
  g["name"] = std::string(300, 'n');
  expect_error([&] { parse_gpu_spec(g.dump(), "t"); }, {"field 'name'", "is longer than 256 bytes"});
  // Unknown keys are quoted by a prefix of 256 bytes.
  j = deepseek();
  j[std::string(10000, 'k')] = 1;
  try {
    parse_model_spec(j.dump(), "t");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_LT(std::string(e.what()).size(), 400u) << e.what();
  }
}

// ---- the fields of gpt-oss's MoE block ----

namespace {
json gpt_oss() { return json::parse(to_json(load_model_spec("gpt-oss-120b"))); }
}  // namespace

TEST(Spec, GptOssFigures) {
  for (const char* name : {"gpt-oss-20b", "gpt-oss-120b"}) {
    SCOPED_TRACE(name);
    const ModelSpec m = load_model_spec(name);
    EXPECT_EQ(m.hidden_size, 2880);
    EXPECT_EQ(m.moe_intermediate_size, 2880);
    EXPECT_EQ(m.num_experts_per_token, 4);
    EXPECT_EQ(m.num_shared_experts, 0);
    EXPECT_EQ(m.expert_format, "mxfp4");
    EXPECT_EQ(m.router.scoring, "topk_softmax");
    EXPECT_TRUE(m.router.logit_bias);
    EXPECT_TRUE(m.expert_bias);
    EXPECT_EQ(m.activation.kind, "clamped_swiglu");
    EXPECT_DOUBLE_EQ(m.activation.alpha, 1.702);
    EXPECT_DOUBLE_EQ(m.activation.limit, 7.0);
    EXPECT_EQ(to_json(parse_model_spec(to_json(m), "roundtrip")), to_json(m));
  }
  EXPECT_EQ(load_model_spec("gpt-oss-20b").num_layers, 24);
  EXPECT_EQ(load_model_spec("gpt-oss-20b").num_routed_experts, 32);
  EXPECT_EQ(load_model_spec("gpt-oss-120b").num_layers, 36);
  EXPECT_EQ(load_model_spec("gpt-oss-120b").num_routed_experts, 128);
  // DeepSeek-style specs leave the new fields out and get the defaults, which to_json leaves out too.
  const ModelSpec v3 = load_model_spec("deepseek-v3");
  EXPECT_EQ(v3.expert_format, "fp8");
  EXPECT_EQ(v3.activation.kind, "silu");
  EXPECT_FALSE(v3.expert_bias);
  EXPECT_FALSE(v3.router.logit_bias);
  const json j = deepseek();
  for (const char* key : {"expert_format", "activation", "expert_bias"}) EXPECT_FALSE(j.contains(key)) << key;
  EXPECT_FALSE(j["router"].contains("logit_bias"));
}

TEST(Spec, RejectsBadExpertFields) {
  auto bad = [](json j, std::initializer_list<std::string> fragments) {
    expect_error([&] { parse_model_spec(j.dump(), "t"); }, fragments);
  };
  json j = gpt_oss();
  j["expert_format"] = "nvfp4";
  bad(j, {"'expert_format' = \"nvfp4\"", "\"fp8\" or \"mxfp4\""});
  j = gpt_oss();
  j["activation"]["kind"] = "gelu";
  bad(j, {"t.activation", "'kind' = \"gelu\""});
  j = gpt_oss();
  j["activation"]["alpha"] = 0;
  bad(j, {"t.activation", "'alpha' = 0", "> 0"});
  j = gpt_oss();
  j["activation"].erase("limit");
  bad(j, {"t.activation", "missing field 'limit'"});
  j = gpt_oss();
  j["activation"] = {{"kind", "silu"}, {"limit", 7.0}};
  bad(j, {"'limit' applies to kind \"clamped_swiglu\" only"});
  j = gpt_oss();
  j["activation"]["beta"] = 1;
  bad(j, {"unknown field 'beta'"});
  j = gpt_oss();
  j["expert_bias"] = "yes";
  bad(j, {"'expert_bias'", "true or false"});
  j = gpt_oss();
  j["router"]["num_groups"] = 8;
  j["router"]["topk_groups"] = 4;
  bad(j, {"topk_softmax", "num_groups = 8 must be 1"});
  j = gpt_oss();
  j["router"]["normalize_topk"] = false;
  bad(j, {"topk_softmax", "normalize_topk must be true"});
  j = gpt_oss();
  j["num_shared_experts"] = 1;
  j["shared_intermediate_size"] = 2880;
  bad(j, {"mxfp4", "no shared experts", "num_shared_experts = 1"});
  j = gpt_oss();
  j["hidden_size"] = 2890;
  bad(j, {"hidden_size = 2890 must be a multiple of 32"});
  j = gpt_oss();
  j["moe_intermediate_size"] = 100;
  bad(j, {"moe_intermediate_size = 100 must be a multiple of 32"});
  // What the FP8 (DeepSeek-V3) layout cannot hold.
  j = deepseek();
  j["expert_bias"] = true;
  bad(j, {"expert_bias = true needs expert_format \"mxfp4\""});
  j = deepseek();
  j["router"]["logit_bias"] = true;
  bad(j, {"logit_bias = true needs expert_format \"mxfp4\""});
  // An FP8 model may use the clamped SwiGLU and top-k-then-softmax: the layer does either format.
  j = deepseek();
  j["activation"] = {{"kind", "clamped_swiglu"}, {"alpha", 1.702}, {"limit", 7.0}};
  j["router"]["scoring"] = "topk_softmax";
  j["router"]["num_groups"] = 1;
  j["router"]["topk_groups"] = 1;
  EXPECT_EQ(parse_model_spec(j.dump(), "t").activation.kind, "clamped_swiglu");
}

// The name is printed to the terminal (moekit plan, spec): no control character may reach it.
TEST(Spec, RejectsControlCharactersInTheName) {
  for (const auto& [name, code, at] : {std::tuple{std::string("deep\x1b[31mseek"), "0x1B", "byte 4"},
                                       std::tuple{std::string("a\nb"), "0x0A", "byte 1"},
                                       std::tuple{std::string("x\x7f"), "0x7F", "byte 1"},
                                       std::tuple{std::string("\0z", 2), "0x00", "byte 0"},
                                       std::tuple{std::string("bad\xC2\x9B" "31mred"), "U+009B", "byte 3"}}) {
    json j = deepseek();
    j["name"] = name;
    expect_error([&] { parse_model_spec(j.dump(), "m.json"); },
                 {"m.json: field 'name'", "control character " + std::string(code), at, "expected printable text"});
    json g = h200();
    g["name"] = name;
    expect_error([&] { parse_gpu_spec(g.dump(), "g.json"); }, {"g.json: field 'name'", "control character"});
  }
  json j = deepseek();
  j["name"] = "DeepSeek-V3 (671B, \xC3\xA9t\xC3\xA9, \xC2\xA0)";  // UTF-8 is printable text, U+00A0 too
  EXPECT_EQ(parse_model_spec(j.dump(), "m.json").name, j["name"]);
}
