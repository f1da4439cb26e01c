// A small gpt-oss-style model for the layer tests (CPU and GPU): MXFP4 experts with biases,
// hidden 160 and inter 96 (padded to 256 and 128 by the loader, so the padding paths run), a
// router with a logit bias, top-4 then softmax, and the clamped SwiGLU with limit 1 (gpt-oss's 7
// would never clamp these values; 1 clamps both branches often).
#pragma once

namespace moekit::testing_models {

inline constexpr const char* kOssModelJson = R"({
  "name": "test-oss", "hidden_size": 160, "num_layers": 1, "num_moe_layers": 1,
  "moe_intermediate_size": 96, "num_routed_experts": 16, "num_experts_per_token": 4,
  "num_shared_experts": 0, "shared_intermediate_size": 0,
  "total_params": 1e7, "active_params": 1e6, "weight_bytes_per_param": 0.53, "kv_bytes_per_token": 1024,
  "router": {"scoring": "topk_softmax", "num_groups": 1, "topk_groups": 1, "routed_scaling_factor": 1.0,
             "normalize_topk": true, "logit_bias": true},
  "expert_format": "mxfp4", "activation": {"kind": "clamped_swiglu", "alpha": 1.702, "limit": 1.0}, "expert_bias": true
})";

}  // namespace moekit::testing_models
