// Internal to src/io: the shapes of one MoE layer's checkpoint tensors, shared by the loader
// (weights.cpp) and the random-weights generator (weights_random.cpp).
#pragma once

#include <cstdint>
#include <string_view>
#include <utility>

#include "moekit/layout.h"
#include "moekit/spec.h"

namespace moekit::weights_detail {

// The three projections of an MLP, in the order the loader fuses them (gate and up into W1).
constexpr std::string_view kProjs[] = {"gate_proj", "up_proj", "down_proj"};

inline int64_t ceil_blocks(int64_t n) { return (n + kQuantBlock - 1) / kQuantBlock; }

// The shapes of one layer's matrices, from the spec.
struct LayerDims {
  int64_t hidden = 0;
  int64_t inter = 0;         // per routed expert
  int64_t shared_inter = 0;  // of the merged shared-expert MLP, 0 when none
  int num_experts = 0;
  bool has_bias = false;  // DeepSeek-V3's e_score_correction_bias (sigmoid routers)
  bool mxfp4 = false;     // gpt-oss's layout (weights.h)
  bool expert_bias = false;
  bool logit_bias = false;
};

// Checks that the spec is an MoE model with fp8 or mxfp4 experts (mxfp4: no shared expert, sizes
// whole groups of 32) and returns its layer's shapes.
LayerDims layer_dims(const ModelSpec& spec);

// (rows, cols) of a projection of an MLP with intermediate size `inter`.
inline std::pair<int64_t, int64_t> proj_shape(std::string_view proj, int64_t hidden, int64_t inter) {
  return proj == "down_proj" ? std::pair{hidden, inter} : std::pair{inter, hidden};
}

}  // namespace moekit::weights_detail
