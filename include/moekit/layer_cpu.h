// moekit/layer_cpu.h: one MoE layer on the CPU, end to end over P in-process ranks: the reference
// of the decode step of docs/design.md §Decode data flow, that every GPU path is checked against.
//
// One step on rank r (forward(), called on rank r's thread, every rank in the same step):
//   gate        x [T, d] bf16 -> router GEMM -> logits [T, E] -> top-k (gating.h) -> topk_idx (logical),
//               topk_weights; or the caller's routing instead (synthetic skew, tests)
//   replica     logical expert -> physical slot by the placement (eplb.h choose_replicas_for_rank:
//               a replica on the token's own rank first)
//   dispatch    ep_cpu.h: low-latency (masked layout, recv_count = masked_m) or normal (counts first,
//               contiguous layout padded to block_m)
//   GEMM1       grouped GEMM (reference.h), W1 = [gate; up] [E_loc, 2 inter, d] -> gate_up bf16
//   activation  SiLU(gate)·up fused with FP8 1x128 quantisation
//   GEMM2       grouped GEMM, W2 [E_loc, d, inter] -> y bf16
//   combine     weighted by topk_weights, summed per (token, rank), summed over ranks at the source
//               in rank order, plus the shared expert's output (computed on the rank's own tokens
//               while the combine is in flight) as the combine's `add` term -> out [T, d] bf16
// Rank r's local expert i is slot r * E_loc + i, holding logical expert phy2log[slot]: the layer
// copies that expert's FP8 weights into the rank's own [E_loc, N, K] arrays at set-up, as a GPU
// would hold them. Buffers are sized at set-up for T_max (normal mode grows its contiguous buffers
// when a step needs more rows).
//
// Numerics are exactly the reference kernels' (reference.h), so the output equals the float64
// oracle (moe_layer_f64 on the same quantised weights) to within the tolerance of
// docs/design.md §Numerics and their bounds, and the FP8 payloads, scales and expert outputs y of a
// (token, logical expert) pair are the same bits for any P or placement, and for either protocol
// of an FP8 layer (an MXFP4 layer's normal mode scales its FP8 activations per token:
// x_scaling()). Only the combine's bf16 partial sums depend on how the experts of a token are
// spread over ranks.
//
// gpt-oss (MXFP4 weights, weights.h): the same stages with the router's logit bias, top-k then
// softmax (gating.h), the MXFP4 GEMMs with the expert biases in their epilogue and the clamped
// SwiGLU (reference.h). The weights are padded to hidden_p and inter_p (multiples of 128); the
// layer pads each step's x [T, hidden] with zero columns to [T, hidden_p] (so FP8 quantisation,
// dispatch and GEMMs see 128-wide blocks), and returns the first hidden columns of the combine's
// [T, hidden_p] output. The padded columns are exactly zero all the way (weights.h), so the padding
// changes no value.
//
// Errors (moekit::Error, before anything is sent): T > T_max, a routing id outside [0, E), NaN or
// infinite logits (from the gate), K = hidden not a multiple of 128 for FP8 weights (at set-up),
// weights of another format or size than the model's, a placement whose slots or experts do not
// match the model.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "moekit/ep_cpu.h"
#include "moekit/reference.h"
#include "moekit/spec.h"

namespace moekit {

struct MoeLayerWeights;  // weights.h
struct Placement;        // eplb.h
struct ExpertMove;       // rebalance.h

enum class EpProtocol { kLowLatency, kNormal };
const char* protocol_name(EpProtocol protocol);  // "low-latency" | "normal"

// How a layer scales its FP8 activations, the dispatched tokens and GEMM2's input (quant.h): per
// token in an MXFP4 layer (both modes), whose GEMMs then keep the whole K in one accumulator
// (gemm.h ContiguousGemmProblem::a_row_scales, MaskedGemmProblem::a_row_scales), 1x128 otherwise.
// Both EP modes scale alike, so a token's FP8 values do not depend on the mode that moved it. The
// CPU and GPU layers, their EP buffers and the oracle's callers take it from here.
Fp8Scaling layer_fp8_scaling(const ModelSpec& model);

struct CpuLayerConfig {
  int num_ranks = 1;   // P
  int max_tokens = 0;  // T_max per rank
  EpProtocol protocol = EpProtocol::kLowLatency;
  int block_m = 64;            // normal mode: expert segment padding (the contiguous GEMM's block M)
  uint64_t replica_seed = 0;   // choose_replicas' hash seed
  double timeout_s = 60.0;     // every wait on a peer
};

// Wall time of each stage of one rank's step, seconds. dispatch and combine include the wait for
// the slowest peer (the all-to-all is a barrier).
struct StageTimes {
  double gate = 0, dispatch = 0, gemm1 = 0, activation = 0, gemm2 = 0, combine = 0, shared = 0;
};

// What one rank's last step saw.
struct RankStep {
  int num_tokens = 0;
  std::vector<int32_t> topk_idx;      // [T, k] logical experts
  std::vector<float> topk_weights;    // [T, k]
  std::vector<int32_t> topk_slot;     // [T, k] physical slots
  std::vector<int32_t> recv_count;    // [E_loc] rows per local expert (masked_m)
  EpStats ep;
  StageTimes times;
};

class CpuMoeLayer {
 public:
  // weights: all E routed experts of the layer (load_moe_layer(ckpt, spec, l, 0, E)), its router and
  // shared experts; placement: its layer `placement_layer` says which logical expert each slot holds
  // (num_gpus == P, num_experts == E). Validates everything before allocating.
  CpuMoeLayer(const ModelSpec& model, const MoeLayerWeights& weights, const Placement& placement, int placement_layer,
              const CpuLayerConfig& config);
  ~CpuMoeLayer();
  CpuMoeLayer(const CpuMoeLayer&) = delete;
  CpuMoeLayer& operator=(const CpuMoeLayer&) = delete;

  // The group this layer's forward() needs (one group can serve every layer of a model).
  EpConfig ep_config() const;
  Fp8Scaling x_scaling() const;  // layer_fp8_scaling(model, protocol)
  const CpuLayerConfig& config() const { return config_; }
  int num_local_experts() const;

  // One step on rank `rank`. x [T, d] bf16 -> out [T, d] bf16. first_token: global index of the
  // rank's token 0 (the replica choice hashes global token ids). routing_idx / routing_weights
  // [T, k]: logical experts and weights to use instead of the gate's (both or neither).
  void forward(LocalEpGroup& group, int rank, int num_tokens, int64_t first_token, const uint16_t* x, uint16_t* out,
               const int32_t* routing_idx = nullptr, const float* routing_weights = nullptr);

  const RankStep& last_step(int rank) const;

  // EPLB while serving, between two steps (no rank inside forward()): switches to `placement`
  // (the same layer index, slots and ranks as the current one) by copying into every moved slot
  // of this layer the weights of the move's source slot, on whichever rank it lives; sources hold
  // their expert in the current placement (rebalance.h plan_moves), and every source is read
  // before any slot is written, as the GPU layer stages them. validate_moves() runs first:
  // a move that does not fit both placements is an Error and nothing changes. Returns the bytes
  // copied (W1, W2 and their scales of each moved slot). FP8 experts only: a layer of MXFP4
  // experts refuses any moves (as the GPU layer, which moves no MXFP4 weights while serving).
  int64_t apply_moves(const Placement& placement, const std::vector<ExpertMove>& moves);

  // The last step's receive side and expert outputs on `rank`, for tests. Low-latency: masked
  // layout [E_loc, M_max, ...] (rows < recv_count valid); normal: contiguous rows (row_expert >= 0 valid).
  // Rows are ep_config().hidden wide: the padded hidden size for MXFP4 weights.
  struct RankBuffers {
    const uint8_t* recv_x = nullptr;
    const float* recv_scales = nullptr;
    const int32_t* recv_src = nullptr;
    const int32_t* row_expert = nullptr;  // normal mode only
    const uint16_t* y = nullptr;
    int rows = 0;  // M_max (low-latency) or M_total (normal)
  };
  RankBuffers buffers(int rank) const;

 private:
  struct Rank;
  void forward_low_latency(LocalEpGroup& group, int rank, const uint16_t* x, Rank& me, StageTimes& times);
  void forward_normal(LocalEpGroup& group, int rank, const uint16_t* x, Rank& me, StageTimes& times);

  ModelSpec model_;
  CpuLayerConfig config_;
  // hidden_ and inter_ are the GEMMs' (padded) sizes; model_hidden_ the model's, of x and out.
  int hidden_ = 0, inter_ = 0, model_hidden_ = 0, shared_inter_ = 0, num_experts_ = 0, topk_ = 0, num_slots_ = 0;
  bool mxfp4_ = false;
  ref::Activation activation_;
  std::vector<float> router_logit_bias_;
  std::vector<int32_t> phy2log_;
  std::unique_ptr<Placement> placement_;
  int placement_layer_ = 0;
  std::vector<float> router_weight_, router_bias_;
  std::vector<uint8_t> shared_w1_, shared_w2_;
  std::vector<float> shared_w1_scales_, shared_w2_scales_;
  std::vector<std::unique_ptr<Rank>> ranks_;
};

// The placement without redundant experts: slot e holds expert e (E slots over P ranks).
Placement identity_placement(int num_experts, int num_ranks);
// EPLB's reference placement (rebalance, one group, one node) of E + redundant slots over P ranks
// for expected per-expert loads [E].
Placement balanced_placement(const std::vector<double>& expert_load, int redundant, int num_ranks);

// The layer's weights dequantised to float64 for the oracle (reference.h moe_layer_f64). FP8 only.
struct LayerWeightsF64 {
  std::vector<double> w1, w2, shared_w1, shared_w2;
  ref::MoeWeightsF64 view;  // points into the vectors above
};
std::unique_ptr<LayerWeightsF64> dequantize_layer_f64(const MoeLayerWeights& weights);

// A spec's activation as the reference kernels take it (constants rounded to fp32).
ref::Activation activation_of(const ActivationSpec& activation);

// The float64 oracle of one layer (reference.h) on its own weights, whatever their format: FP8
// weights are dequantised once here (moe_layer_f64), MXFP4 ones are decoded expert by expert in
// each run() (moe_layer_mxfp4_f64, on x zero-padded to hidden_p, its output cropped back to
// hidden). `weights` (all E experts) must outlive the oracle.
class LayerOracle {
 public:
  LayerOracle(const ModelSpec& model, const MoeLayerWeights& weights);
  // x [T, hidden] fp32, topk_idx / topk_weights [T, k] -> out [T, hidden] float64. scaling: the
  // layer's FP8 activations' (CpuMoeLayer::x_scaling()); per token only for MXFP4 weights.
  void run(const float* x, int num_tokens, const int32_t* topk_idx, const float* topk_weights, double* out,
           Fp8Scaling scaling = Fp8Scaling::kPerBlock) const;

 private:
  int hidden_ = 0, topk_ = 0;
  std::unique_ptr<LayerWeightsF64> fp8_;  // FP8 weights, dequantised
  ref::MoeWeightsMxfp4 mxfp4_;            // MXFP4 weights, a view
};

}  // namespace moekit
