// moekit/spec.h: model, GPU and deployment descriptions.
//
// A spec is a JSON object. Specs are embedded in the binary (configs/models/*.json and
// configs/gpus/*.json, looked up by file stem, e.g. "deepseek-v3", "h200") and can be read
// from any path. Every field is validated before a spec is returned: a missing field, a
// wrong type, a non-positive size, k > E or an unknown key is an Error naming the field, the
// value and what was expected. Nothing is computed from a spec that failed validation.
//
// Every number has a range, checked in the type it is stored in, so that nothing computed from
// a valid spec overflows: counts within moekit/limits.h (E <= kMaxExperts, layers <=
// kMaxLayers, sizes <= kMaxHiddenSize, gpus_per_node <= kMaxRanks); parameters in [1, 1e15];
// weight_bytes_per_param in [0.01, 64]; kv_bytes_per_token in [1, 1e12]; hbm_bytes in
// [1e6, 1e15]; bandwidths in [1e6, 1e16] B/s; FLOP rates in [1e6, 1e18]; latencies in
// [1e-3, 1e6] us; routed_scaling_factor in [1e-6, 1e6]; a name of at most 256 bytes. An
// integer may be written 8, 8.0 or 8e0, never 8.5.
//
// Units: bytes, bytes per second (one direction), FLOP per second (dense), microseconds.
// A model with num_routed_experts == 0 is dense (its MoE fields are 0 and it has no router: a
// "router" field is an Error).
//
// Fields for experts that differ from DeepSeek-style ones (gpt-oss) are optional; leaving them
// out gives the DeepSeek-style default, and to_json writes them only when they differ from it:
//   "expert_format": "fp8" (default: DeepSeek-V3's FP8 checkpoint layout, 128x128 block scales)
//                  | "mxfp4" (gpt-oss's Hugging Face layout: e2m1 values, one e8m0 scale per 32
//                    along K; see weights.h). MXFP4 needs no shared experts and hidden_size and
//                    moe_intermediate_size multiples of 32 (the scale group, along K of each GEMM).
//   "activation": {"kind": "silu"} (default: SiLU(gate)·up)
//               | {"kind": "clamped_swiglu", "alpha": A, "limit": L} (gpt-oss: A = 1.702, L = 7):
//                 (clamp(up, -L, L) + 1)·g·sigmoid(A·g) with g = min(gate, L), gate clamped
//                 from above only. A and L in [1e-6, 1e6].
//   "expert_bias": false (default) | true: every expert's gate/up and down projections add a bias
//                  (gpt-oss; only the mxfp4 layout has them).
//   router "logit_bias": false (default) | true: logits = x·W^T + b (gpt-oss's router is a linear
//                  layer with bias; only the mxfp4 layout has it). Not DeepSeek-V3's
//                  e_score_correction_bias, which sigmoid routers always have and which steers the
//                  selection only.
//   router "scoring": "topk_softmax" (gpt-oss): the k largest logits, then a softmax over those k.
//                  Needs num_groups = 1 and normalize_topk = true (a softmax over the k sums to 1).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moekit {

struct RouterSpec {
  std::string scoring = "softmax";  // "softmax" | "sigmoid" | "topk_softmax"
  int num_groups = 1;               // expert groups (DeepSeek-V3: 8)
  int topk_groups = 1;              // groups kept per token (DeepSeek-V3: 4)
  double routed_scaling_factor = 1.0;
  bool normalize_topk = true;
  bool logit_bias = false;          // logits = x·W^T + b (gpt-oss)
};

// The experts' activation on GEMM1's gate and up outputs (see the contract above).
struct ActivationSpec {
  std::string kind = "silu";  // "silu" | "clamped_swiglu"
  double alpha = 0;           // clamped_swiglu only (gpt-oss: 1.702)
  double limit = 0;           // clamped_swiglu only (gpt-oss: 7.0)
};

struct ModelSpec {
  std::string name;
  int64_t hidden_size = 0;
  int num_layers = 0;
  int num_moe_layers = 0;
  int64_t moe_intermediate_size = 0;
  int num_routed_experts = 0;     // E
  int num_experts_per_token = 0;  // k
  int num_shared_experts = 0;
  int64_t shared_intermediate_size = 0;
  double total_params = 0;
  double active_params = 0;
  double weight_bytes_per_param = 0;  // bpp
  double kv_bytes_per_token = 0;      // all layers
  RouterSpec router;
  std::string expert_format = "fp8";  // "fp8" | "mxfp4"
  ActivationSpec activation;
  bool expert_bias = false;

  bool is_moe() const { return num_routed_experts > 0; }
  // Parameters of one routed expert: gate, up and down projections (SwiGLU).
  double params_per_expert() const { return 3.0 * double(hidden_size) * double(moe_intermediate_size); }
};

struct GpuSpec {
  std::string name;
  double hbm_bytes = 0;
  double hbm_bandwidth = 0;     // B/s
  double fp8_flops = 0;         // dense FLOP/s
  double bf16_flops = 0;        // dense FLOP/s
  double nvlink_bandwidth = 0;  // B/s, one direction, per GPU
  double nvlink_latency_us = 0;
  double network_bandwidth = 0;  // B/s per GPU
  double network_latency_us = 0;
  int gpus_per_node = 0;
};

// Parse and validate. `origin` names the source in error messages (a path or "embedded:NAME").
ModelSpec parse_model_spec(std::string_view json_text, std::string_view origin);
GpuSpec parse_gpu_spec(std::string_view json_text, std::string_view origin);

// Look up an embedded spec by name, or read a file when `name_or_path` names one
// (contains '/' or ends in ".json"). Unknown names list the embedded ones.
ModelSpec load_model_spec(std::string_view name_or_path);
GpuSpec load_gpu_spec(std::string_view name_or_path);

std::vector<std::string> embedded_model_names();
std::vector<std::string> embedded_gpu_names();

// The JSON text of a spec, for printing and round trips.
std::string to_json(const ModelSpec& model);
std::string to_json(const GpuSpec& gpu);

}  // namespace moekit
