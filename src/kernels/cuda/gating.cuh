// Internal to moekit_cuda: the router on the GPU (gating.cu) and the replica map. The layer
// (src/layer/cuda/layer.cu) launches these; their numerics are gating.h's and eplb.h's, and
// docs/layer-gpu.md says where they can differ from the CPU's bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moekit::gpu {

// A device-side fault of the layer's kernels: the first one is kept (kind set by atomicCAS).
enum class LayerFault : int { kNone = 0, kNonFiniteLogit = 1, kBadExpert = 2 };
struct LayerStatus {
  int kind;   // LayerFault
  int token;  // the rank's token
  int entry;  // expert (logit) or top-k position (routing)
  float value;
};

struct RouterParams {
  bool sigmoid = false;  // else softmax
  int num_groups = 1;    // <= 32
  int topk_groups = 1;
  bool normalize = true;
  double scaling = 1.0;
};

// logits [T, E] fp32 = x [T, d] bf16 . w [E, d] fp32 ^T, each dot product summed in fp64 and
// rounded once to fp32 (the products are exact in fp64; only the summation order differs from
// gating.h's, see docs/layer-gpu.md).
void launch_router_logits(const uint16_t* x, int num_tokens, int hidden, const float* router_weight, int num_experts,
                          float* logits, cudaStream_t stream);

// gating.h select_experts on the device, one warp per token. E <= kMaxGateExperts. A token with
// a non-finite logit gets topk_idx -1 (no expert), weights 0, and a kNonFiniteLogit record.
constexpr int kMaxGateExperts = 1024;
void launch_select_experts(const float* logits, int num_tokens, int num_experts, int k, const RouterParams& router,
                           const float* bias, int32_t* topk_idx, float* topk_weights, LayerStatus* status,
                           cudaStream_t stream);

// The replica map of eplb.h choose_replicas_for_rank, per (token, entry): logical expert ->
// physical slot. routing_idx/routing_weights (the caller's, or null: then topk_idx/topk_weights
// already hold the gate's) are copied into topk_idx/topk_weights first. -1 stays -1; an id outside
// [-1, E) becomes -1 with a kBadExpert record. counts[e] += 1 for every valid entry.
struct ReplicaTable {
  const int32_t* log2phy = nullptr;        // [E, max_replicas]
  const int32_t* replica_count = nullptr;  // [E]
  int max_replicas = 1;
  int slots_per_gpu = 1;
  int num_experts = 0;
};
void launch_map_replicas(const ReplicaTable& table, int rank, int64_t first_token, uint64_t seed, int num_tokens, int k,
                         const int32_t* routing_idx, const float* routing_weights, int32_t* topk_idx,
                         float* topk_weights, int32_t* topk_slot, unsigned long long* counts, LayerStatus* status,
                         cudaStream_t stream);

}  // namespace moekit::gpu
