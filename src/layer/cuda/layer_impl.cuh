// Internal to src/layer/cuda: what one GpuMoeLayer holds (include/moekit/layer.h), shared by
// layer_setup.cu (the constructor), layer.cu (the step's three phases), layer_weights.cu (the
// slots' upload) and layer_placement.cu (placements and the staged weight moves between GPUs).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "kernels/cuda/activation.cuh"
#include "kernels/cuda/gating.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/silu_fp8.cuh"
#include "layer/cuda/expert_mover.h"
#include "moekit/cuda_check.h"
#include "moekit/eplb.h"
#include "moekit/gemm.h"
#include "moekit/layer.h"
#include "moekit/rebalance.h"
#include "moekit/weights.h"

namespace moekit::gpu {

// The stage events of a timed eager step (set_timing), in step order.
enum Stage { kStart, kGate, kSend, kRecv, kGemm1, kAct, kGemm2, kCombineSend, kCombineRecv, kNumStages };

constexpr int kNumClocks = int(GpuStage::kCount);  // the stage clock's pairs

struct GpuMoeLayer::Impl {
  GpuLayerConfig cfg;
  EpBuffer* ep = nullptr;
  EpConfig ec;
  bool decode = true;
  bool fused = false;  // decode with GpuPipeline::kFused
  // The shared expert has the routed experts' shapes: its weights are local slot E_loc of W1 and
  // W2 (always, so layers sharing weights agree), and in the fused pipeline it is expert E_loc of
  // the routed GEMMs, its rows the EP buffer's self slab (EpConfig::self_slab).
  bool shared_slot = false, merged = false;
  // Staged: the shared expert's GEMMs on the side stream, forked before the gate and joined before
  // the combine receive (GpuLayerConfig::overlap_shared; else in line on the caller's stream).
  bool side_shared = false;
  // Fused: GEMM1 with the SiLU·up + FP8 epilogue (else GEMM1 to BF16 and the activation kernel).
  bool gated = false;
  int32_t* expert_ready = nullptr;  // fused + gated: GEMM1 -> GEMM2 per-expert readiness [slabs + 1]
  int32_t* recv_ready = nullptr;    // fused, FP8: receive -> GEMM1 rows per expert [slabs + 2] (GpuLayerConfig)
  int recv_ctas = 0;                // the receive's grid when recv_ready is set
  int32_t* combine_ready = nullptr; // fused, FP8: GEMM2 -> combine send per-expert readiness [slabs]
  int combine_ctas = 0;             // the combine send's grid when combine_ready is set
  // MXFP4 experts (gpt-oss): d and inter are the weights' padded sizes (weights.h), model_d the
  // model's hidden size; where they differ, the kernels read x and write out as [T, model_d] rows,
  // or (a shared expert, a row length not a multiple of 16) through x_pad and out_pad.
  bool mxfp4 = false;
  bool token_scales = false;  // FP8 activations scaled per token (layer_fp8_scaling: an MXFP4 layer)
  int rank = 0, d = 0, model_d = 0, inter = 0, shared_inter = 0, num_experts = 0, k = 0, e_loc = 0, t_max = 0,
      m_max = 0;
  std::shared_ptr<const ActivationTable> activation_table;  // the owner's when sharing weights
  GpuActivation activation;  // activation_table->act()
  int rows = 0, t_pad = 0;
  int num_sms = 0;  // the device's, for the plans and grids made at set-up
  RouterParams router;
  ReplicaTable replicas;
  int32_t *log2phy = nullptr, *replica_count = nullptr;
  std::vector<int32_t> local_experts;  // the logical expert of each local slot
  // The placement served (all its layers) and this layer's row of it; the moves' plan.
  std::unique_ptr<Placement> current, pending;
  int placement_layer = 0;
  SlotBytes slot_bytes;
  std::unique_ptr<ExpertMover> mover;  // staging_slots > 0
  std::vector<GpuExpertSlots> peers;   // [P] or empty: where moves may copy from
  Impl* owner = nullptr;               // the layer whose weights this one uses (share_weights_with)
  int num_sharers = 0;                 // layers using this one's weights
  std::vector<void*> allocations;

  float *router_w = nullptr, *router_bias = nullptr, *router_logit_bias = nullptr;
  uint8_t *w1 = nullptr, *w2 = nullptr, *sw1 = nullptr, *sw2 = nullptr;
  float *w1s = nullptr, *w2s = nullptr, *sw1s = nullptr, *sw2s = nullptr;
  // MXFP4: w1/w2 hold the GEMM's code order, these the scale words and the biases (gemm.h).
  uint32_t *w1_mx = nullptr, *w2_mx = nullptr;
  float *b1 = nullptr, *b2 = nullptr;
  uint16_t *x_pad = nullptr, *out_pad = nullptr;  // [T_max, d], or null (above)
  float* logits = nullptr;
  int32_t *topk_idx = nullptr, *topk_slot = nullptr;
  float* topk_w = nullptr;
  unsigned long long* counts = nullptr;
  LayerStatus* status = nullptr;
  uint16_t *gate_up = nullptr, *y = nullptr;
  uint8_t* act = nullptr;
  float* act_scales = nullptr;
  // Shared expert: the rank's tokens as one masked expert of t_pad rows.
  uint8_t *sx = nullptr, *s_act = nullptr;
  float *sx_scales = nullptr, *s_act_scales = nullptr;
  int32_t* s_m = nullptr;
  uint16_t *s_gate_up = nullptr, *s_out = nullptr;

  std::unique_ptr<MaskedGemm> gemm1, gemm2, shared1, shared2;
  std::unique_ptr<ContiguousGemm> cgemm1, cgemm2;
  cudaStream_t side = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
  bool timing = false, timed_step = false;
  cudaEvent_t events[kNumStages] = {};
  // Stage clock: [GpuStage][start, end] and the reset image the step starts by copying in.
  bool timeline = false;
  unsigned long long *clocks = nullptr, *clocks_reset = nullptr;
  int num_tokens = 0;
  enum class Phase { kIdle, kDispatched, kComputed } phase = Phase::kIdle;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl();

  // The FP8 copy both contiguous MXFP4 GEMMs widen into: the config's workspace, or allocated here.
  uint8_t* fp8_copy_workspace(const ContiguousGemmProblem& p1, const ContiguousGemmProblem& p2);
  template <class T>
  T* alloc(size_t count) {
    void* p = nullptr;
    MOEKIT_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)));
    allocations.push_back(p);
    return static_cast<T*>(p);
  }
  template <class T>
  T* upload(const std::vector<T>& host) {
    T* p = alloc<T>(host.size());
    MOEKIT_CUDA_CHECK(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    return p;
  }
  void mark(Stage s, cudaStream_t stream) {
    if (timed_step) MOEKIT_CUDA_CHECK(cudaEventRecord(events[s], stream));
  }
  // The constructor's parts, in its order (layer_setup.cu): check the arguments against each other
  // and take the shapes; the weights (other's when sharing them), activation table, replica table
  // and mover; the gate's per-token buffers; staged or fused, merged shared expert, gated
  // epilogue, hand-off counters; the experts' activation and output buffers and the shared
  // expert's; the GEMM plans; the stage clock, side stream and events.
  void take_shapes(const ModelSpec& model, const MoeLayerWeights& weights, const Placement& placement,
                   int placement_layer);
  void set_up_weights(const ModelSpec& model, const MoeLayerWeights& weights, const Placement& placement,
                      int placement_layer, const Impl* other);
  void allocate_token_state();
  void choose_pipeline();
  void allocate_expert_buffers(const MoeLayerWeights& weights);
  void plan_gemms();
  void create_clocks_and_streams();
  // Experts of the routed GEMMs (the local slots, and the merged shared expert) and their rows.
  int routed_slabs() const { return e_loc + (merged ? 1 : 0); }
  size_t routed_rows() const { return decode ? size_t(routed_slabs()) * m_max : size_t(rows); }
  // Rows per active local expert the GEMM heuristic plans for (GpuLayerConfig::expected_m).
  int planned_m() const;
  // The rank's weights (layer_weights.cu): those of `other` (share_weights_with: same rank, model
  // and placement, checked), or gathered from all experts and uploaded.
  void share_weights(const Impl& other, const int32_t* phy2log);
  void upload_weights(const MoeLayerWeights& weights, const int32_t* phy2log);
  void run_shared(const uint16_t* x, cudaStream_t stream);
  // The launch options of a stage's kernels: PDL in the fused pipeline, the stage's stamp pair.
  LaunchOptions launch(GpuStage stage) const {
    return {fused, timeline ? clocks + 2 * int(stage) : nullptr};
  }
  void set_clocks(bool on);
  // Writes the placement's log2phy (at the fixed stride) and replica_count, on `stream` (or
  // synchronously when null).
  void upload_table(const Placement& placement, int layer, cudaStream_t stream);
};

// The MXFP4 operand of e_loc slots (slot i holds logical expert phy2log[first_slot + i]) in the
// GEMM's encodings (mxfp4.h): codes in fragment order, one scale word per (expert, 128-deep block,
// row), and the biases (empty without expert biases). Each slot's part of every output is one run.
void gather_mxfp4(const Mxfp4ExpertWeights& all, const int32_t* phy2log, int first_slot, int e_loc,
                  std::vector<uint8_t>& codes, std::vector<uint32_t>& words, std::vector<float>& bias);

}  // namespace moekit::gpu
