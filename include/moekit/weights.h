// moekit/weights.h: the MoE weights of one layer, loaded from a DeepSeek-style FP8 checkpoint or
// a gpt-oss MXFP4 one (the spec's expert_format says which), and a generator of random checkpoints
// of either format for any model spec.
//
// ---- FP8 (expert_format "fp8", DeepSeek-V3) ------------------------------------------------
//
// Checkpoint naming (DeepSeek-V3's Hugging Face checkpoint; `l` is the layer index as written in
// the file, `e` the global expert id):
//   model.layers.{l}.mlp.experts.{e}.gate_proj.weight              F8_E4M3 [inter, hidden]
//   model.layers.{l}.mlp.experts.{e}.up_proj.weight                F8_E4M3 [inter, hidden]
//   model.layers.{l}.mlp.experts.{e}.down_proj.weight              F8_E4M3 [hidden, inter]
//   <each of the above>_scale_inv                                   F32 [ceil(rows/128), ceil(cols/128)]
//   model.layers.{l}.mlp.gate.weight                                BF16 or F32 [E, hidden] (router)
//   model.layers.{l}.mlp.gate.e_score_correction_bias               F32 [E] (sigmoid routers only)
//   model.layers.{l}.mlp.shared_experts.{gate,up,down}_proj.weight (+ _scale_inv), as the experts'
//     but with inter_s = num_shared_experts * shared_intermediate_size: the shared experts of a
//     layer are stored as one MLP, as DeepSeek-V3 does.
// A weight's value is fp8_e4m3_to_float(w) * weight_scale_inv[row / 128][col / 128]: the
// "_scale_inv" is the dequantisation factor, the same as quant.h's scale.
//
// The fused gate/up convention (what the GEMM1 of the layer reads): for local expert i,
//   W1[i] = [ gate_proj.weight ; up_proj.weight ]    [2*inter, hidden]: rows [0, inter) are gate,
//                                                     rows [inter, 2*inter) are up,
// and its scales are the gate's block rows followed by the up's, so GEMM1's output row n < inter
// is the gate projection of column n, n >= inter the up projection of column n - inter, and the
// activation computes SiLU(out[n]) * out[n + inter]. W2[i] = down_proj.weight [hidden, inter].
// Both are stored in layout.h's WeightLayout order ([E_loc, N, K], scales [E_loc, N/128, K/128]),
// which requires hidden and inter to be multiples of 128 (the loader checks).
//
// Random checkpoints: every tensor's values depend only on the seed and the tensor's name, so a
// subset of experts or layers, or a different shard size, gives the same bytes for the tensors
// it holds. Weights are drawn from N(0, 1/fan_in) (fan_in = the matrix's column count, its K),
// then quantised per 128x128 block with quant.h's rule (partial edge blocks get their own
// scale); the router weight from N(0, 1/hidden) stored as BF16, as in DeepSeek-V3; the bias
// from N(0, 0.05^2).
//
// ---- MXFP4 (expert_format "mxfp4", gpt-oss's Hugging Face layout) ----------------------------
// Every expert of a layer in one tensor (values: mxfp4.h):
//   model.layers.{l}.mlp.experts.gate_up_proj_blocks   U8 [E, 2*inter, hidden/32, 16]
//   model.layers.{l}.mlp.experts.gate_up_proj_scales   U8 [E, 2*inter, hidden/32]  (e8m0)
//   model.layers.{l}.mlp.experts.gate_up_proj_bias     BF16 or F32 [E, 2*inter]    (expert_bias)
//   model.layers.{l}.mlp.experts.down_proj_blocks      U8 [E, hidden, inter/32, 16]
//   model.layers.{l}.mlp.experts.down_proj_scales      U8 [E, hidden, inter/32]
//   model.layers.{l}.mlp.experts.down_proj_bias        BF16 or F32 [E, hidden]     (expert_bias)
//   model.layers.{l}.mlp.router.weight                 BF16 or F32 [E, hidden]
//   model.layers.{l}.mlp.router.bias                   BF16 or F32 [E]             (router logit_bias)
// A block's 16 bytes are 32 consecutive values of a row, low nibble first, with the scale byte of
// the same [e, row, block] index: a row of blocks is exactly an Mxfp4WeightLayout row. Gate and up
// are interleaved: row 2j of gate_up (and bias 2j) is the gate projection of intermediate column
// j, row 2j + 1 its up projection.
// The loader turns this into the fused convention above: W1 rows [0, inter_p) are the gate rows
// (file rows 0, 2, 4, ...), rows [inter_p, 2*inter_p) the up rows (1, 3, 5, ...), biases likewise.
// It pads K and N to multiples of 128, so the GEMMs, the FP8 activation groups and the dispatch
// keep their 128-wide blocks: hidden_p = ceil(hidden/128)*128, inter_p likewise (2880 -> 2944).
// Padding values are zero codes with scale byte 127 and zero biases, so every padded GEMM output
// is exactly 0 and the activation of a padded column is 0 (SiLU(0)*0 and the clamped SwiGLU's
// (0 + 1)*0*sigmoid(0) both): results are unchanged. A scale byte above kMxfp4MaxScale (252, and
// 255 which is NaN) or a non-finite bias is an Error naming the tensor, expert, row and block.
//
// Random MXFP4 checkpoints: values drawn as for FP8 (N(0, 1/fan_in) by row), one stream per tensor
// name and expert ("<name>#<e>", so a layer's experts are drawn in parallel), quantised per 32 by
// mxfp4.h's OCP rule; biases N(0, 0.1^2) and the router N(0, 1/hidden), bias N(0, 0.05^2), all
// stored as BF16 as gpt-oss ships them. A tensor holds every expert, so
// the generator writes all experts of a layer (a subset of experts is an Error).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "moekit/layout.h"
#include "moekit/safetensors.h"
#include "moekit/spec.h"

namespace moekit {

// gpt-oss tensor names: proj "gate_up_proj" or "down_proj", part "blocks", "scales" or "bias".
std::string gpt_oss_expert_tensor_name(int layer, std::string_view proj, std::string_view part);
std::string gpt_oss_router_weight_name(int layer);
std::string gpt_oss_router_bias_name(int layer);

// Tensor names. `proj` is "gate_proj", "up_proj" or "down_proj".
std::string expert_weight_name(int layer, int expert, std::string_view proj);
std::string shared_expert_weight_name(int layer, std::string_view proj);
std::string router_weight_name(int layer);
std::string router_bias_name(int layer);
// "<weight name>_scale_inv"
std::string scale_inv_name(std::string_view weight_name);
// The shape of the block scales of a [rows, cols] matrix: [ceil(rows/128), ceil(cols/128)].
std::vector<int64_t> block_scale_shape(int64_t rows, int64_t cols);

// One GEMM's weight operand for E_loc experts, in WeightLayout order.
struct ExpertWeights {
  WeightLayout layout;
  std::vector<uint8_t> w;     // [E_loc, N, K] fp8 e4m3, layout.w_elems()
  std::vector<float> scales;  // [E_loc, N/128, K/128], layout.scale_elems()
};

// One GEMM's MXFP4 weight operand for E_loc experts, in Mxfp4WeightLayout order, and its bias.
struct Mxfp4ExpertWeights {
  Mxfp4WeightLayout layout;
  std::vector<uint8_t> w;       // [E_loc, N, K/2], layout.w_bytes()
  std::vector<uint8_t> scales;  // [E_loc, N, K/32] e8m0, layout.scale_elems()
  std::vector<float> bias;      // [E_loc, N], empty without expert biases
};

// The weights one rank needs for one MoE layer: local experts [first_expert, first_expert + E_loc).
struct MoeLayerWeights {
  int layer = 0;
  int first_expert = 0;  // global id of local expert 0
  int num_experts = 0;   // E, all routed experts (the router's rows)
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // per expert
  ExpertWeights w1;               // [E_loc, 2*inter, hidden], gate rows then up rows (see above)
  ExpertWeights w2;               // [E_loc, hidden, inter]
  std::vector<float> router_weight;  // [E, hidden], fp32 (BF16 in the file converts exactly)
  std::vector<float> router_bias;    // [E] for sigmoid routers, empty otherwise
  // Shared experts as one MLP (num_experts = 1 in the layouts), empty layouts when the model has none.
  ExpertWeights shared_w1;  // [1, 2*inter_s, hidden]
  ExpertWeights shared_w2;  // [1, hidden, inter_s]
  // MXFP4 checkpoints (see above): w1, w2 and the shared experts are empty and these hold the
  // experts, padded: hidden_p = padded_hidden, inter_p = padded_intermediate.
  int64_t padded_hidden = 0;        // K of GEMM1, N of GEMM2: hidden_size rounded up to 128 (the loader
                                    // sets it to hidden_size for FP8, whose users may leave it 0)
  int64_t padded_intermediate = 0;  // intermediate_size rounded up to 128 (likewise)
  Mxfp4ExpertWeights w1_mxfp4;      // [E_loc, 2*inter_p, hidden_p], gate rows then up rows; bias [E_loc, 2*inter_p]
  Mxfp4ExpertWeights w2_mxfp4;      // [E_loc, hidden_p, inter_p]; bias [E_loc, hidden_p]
  std::vector<float> router_logit_bias;  // [E] when the router adds a bias to its logits (gpt-oss), else empty

  bool is_mxfp4() const { return w1_mxfp4.layout.num_experts > 0; }
  int num_local_experts() const { return is_mxfp4() ? w1_mxfp4.layout.num_experts : w1.layout.num_experts; }
  bool has_shared_experts() const { return shared_w1.layout.num_experts > 0; }
};

// The hidden and intermediate sizes of a layer's expert weights as load_moe_layer leaves them
// (MoeLayerWeights::padded_hidden, padded_intermediate): the spec's for FP8, rounded up to
// multiples of 128 for MXFP4 (see above). The GPU layer and the benchmarks size their buffers by it.
struct ExpertWeightSizes {
  int64_t hidden = 0;
  int64_t intermediate = 0;
};
ExpertWeightSizes loaded_expert_sizes(const ModelSpec& spec);

// Loads layer `layer` of `ckpt` for the experts [first_expert, first_expert + num_local_experts),
// in the layout of spec.expert_format. Every tensor is checked against the spec's shapes and
// dtypes; a missing tensor, or one of the wrong dtype or shape, is an Error naming the tensor and
// the file.
MoeLayerWeights load_moe_layer(const Checkpoint& ckpt, const ModelSpec& spec, int layer, int first_expert,
                               int num_local_experts);

struct RandomWeightsOptions {
  int first_layer = 0;   // layers [first_layer, first_layer + num_layers) are written
  int num_layers = -1;   // -1: spec.num_moe_layers
  int first_expert = 0;  // routed experts [first_expert, first_expert + num_experts) are written
  int num_experts = -1;  // -1: all the rest; the router and shared experts are always written.
                         // MXFP4: all experts only (one tensor holds them)
  uint64_t seed = 0;
  uint64_t max_shard_bytes = uint64_t(4) << 30;  // a file grows past it only to hold one matrix
};

struct WeightShard {
  std::string file_name;  // "model-00001-of-00003.safetensors"
  std::vector<TensorDecl> tensors;
  uint64_t file_bytes = 0;  // header included: the size the file will have
};

struct RandomWeightsPlan {
  std::vector<WeightShard> shards;
  uint64_t tensor_bytes = 0;  // the index's total_size
  uint64_t file_bytes = 0;    // everything written, index file excluded
};

// What write_random_weights will write, without writing anything: call it first to tell the user
// the size. Errors for a dense spec or options outside the spec.
RandomWeightsPlan plan_random_weights(const ModelSpec& spec, const RandomWeightsOptions& options);

// Writes the planned shards and model.safetensors.index.json into `dir` (created if missing). `dir`
// must be new, empty, or hold only an earlier run's files (shards with the generator's metadata,
// its index, their .tmp files), which are removed first; anything else is an Error naming the file,
// since a real checkpoint's shards have the same names.
// `progress(bytes_done, bytes_total)` is called after each tensor when given. Returns the plan.
RandomWeightsPlan write_random_weights(const ModelSpec& spec, const RandomWeightsOptions& options, const std::string& dir,
                                       const std::function<void(uint64_t, uint64_t)>& progress = {});

}  // namespace moekit
