// Internal to moekit_cuda: the router on the GPU (gating.cu) and the replica map. The layer
// (src/layer/cuda/layer.cu) launches these; their numerics are gating.h's and eplb.h's, and
// docs/layer-gpu.md says where they can differ from the CPU's bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/launch.cuh"

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
  bool topk_softmax = false;  // gpt-oss: top-k on the logits, softmax over the k (gating.h)
};

// logits [T, E] fp32 = x [T, d] bf16 . w [E, d] fp32 ^T (+ logit_bias [E] when not null: gpt-oss),
// each dot product and its bias summed in fp64 and rounded once to fp32 (the products are exact in
// fp64; the summation order is gating.h's up to the fp64 roundings the kernels cannot pin, see
// docs/layer-gpu.md). x_cols > 0: x is [T, x_cols] (a multiple of 4, at most d), the rest of each
// row zero (a padded hidden size).
//
// Two kernels, one result within fp64 rounding: kWarps (each warp one expert for 8 tokens, a
// lane every 128th column, the lanes' sums added in a tree), and kTiles (a CTA 64 tokens x 64
// experts through a ring of shared-memory stages on the fp64 tensor cores, each logit summed from
// the bias 4 columns at a time in column order: with one split its logits were gating.h's bits on
// every test case), whose K may be split over the 2, 4, 8 or 16 CTAs of a cluster that add their
// partial sums in a fixed order (decode's few tiles). kWarps widens both operands of every product
// to fp64; it pays only for a token or two of a small router, where even 16 splits of the tiles
// make a couple of stages behind their fixed start.
// choose_router_config weighs the two by their measured costs. Why the bits can differ:
// docs/layer-gpu.md §Numerics: what is the same bits. MOEKIT_ROUTER=warps, tiles or tiles:S sets
// the kernel over the heuristic for a study. Throws moekit::Error naming the value for hidden or
// x_cols not a multiple of 4, x_cols > hidden, or splits outside 1..16 (and at most x_cols / 32,
// rounded up: a split takes whole 32-column stages).
enum class RouterKernel { kAuto, kWarps, kTiles };
struct RouterConfig {
  RouterKernel kernel = RouterKernel::kAuto;  // kAuto: MOEKIT_ROUTER, else choose_router_config
  int splits = 1;                             // kTiles: CTAs splitting K, 1..8 (0: the heuristic's)
  std::string to_string() const;              // "warps", "tiles:S"
};
RouterConfig choose_router_config(int num_tokens, int num_experts, int hidden, int num_sms);
void launch_router_logits(const uint16_t* x, int num_tokens, int hidden, const float* router_weight, int num_experts,
                          float* logits, cudaStream_t stream, const LaunchOptions& opt = {},
                          const float* logit_bias = nullptr, int x_cols = 0, RouterConfig config = {});

// The replica map of eplb.h choose_replicas_for_rank, per (token, entry): logical expert ->
// physical slot, and counts[e] += 1 for every valid entry (EPLB statistics).
struct ReplicaTable {
  const int32_t* log2phy = nullptr;        // [E, max_replicas]
  const int32_t* replica_count = nullptr;  // [E]
  int max_replicas = 1;
  int slots_per_gpu = 1;
  int num_experts = 0;
};
struct ReplicaMap {
  ReplicaTable table;
  int rank = 0;
  int64_t first_token = 0;  // global index of the rank's token 0 (the hash uses global ids)
  uint64_t seed = 0;
  int32_t* topk_slot = nullptr;  // [T, k] out
  unsigned long long* counts = nullptr;  // [E]
};

// gating.h select_experts on the device, one warp per token. E <= kMaxGateExperts. A token with
// a non-finite logit gets topk_idx -1 (no expert), weights 0, and a kNonFiniteLogit record.
// With `map`, the same kernel also writes each entry's physical slot (the fused pipeline's one
// gate kernel); without, launch_map_replicas does it.
constexpr int kMaxGateExperts = 1024;
void launch_select_experts(const float* logits, int num_tokens, int num_experts, int k, const RouterParams& router,
                           const float* bias, int32_t* topk_idx, float* topk_weights, LayerStatus* status,
                           cudaStream_t stream, const ReplicaMap* map = nullptr, const LaunchOptions& opt = {});

// The replica map alone: routing_idx/routing_weights (the caller's, or null: then topk_idx/
// topk_weights already hold the gate's) are copied into topk_idx/topk_weights first. -1 stays -1;
// an id outside [-1, E) becomes -1 with a kBadExpert record.
void launch_map_replicas(const ReplicaMap& map, int num_tokens, int k, const int32_t* routing_idx,
                         const float* routing_weights, int32_t* topk_idx, float* topk_weights, LayerStatus* status,
                         cudaStream_t stream, const LaunchOptions& opt = {});

}  // namespace moekit::gpu
