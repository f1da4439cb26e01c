// moekit/eplb.h: expert-parallel load balancing (the EPLB role).
//
// All-to-all is a barrier, so an MoE layer takes as long as its busiest GPU. A placement puts
// `num_slots` physical expert slots per layer on `num_gpus` GPUs (slot p lives on GPU
// p / (num_slots / num_gpus); GPUs are numbered node-major, `num_gpus / num_nodes` per node)
// and says which logical expert each slot holds. Hot experts get several replicas; a token's
// pair (token, expert) is served by exactly one replica.
//
// What this header offers, each with its contract below:
//   rebalance()                     DeepSeek's reference EPLB, reproduced exactly
//                                   (docs/eplb.md §The reference algorithm (exact)).
//   rebalance_with_fewer_moves()    a placement within a tolerance of a fresh rebalance that
//                                   keeps most replicas where they already are.
//   rebalance_dual()                balances GEMM rows and de-duplicated received tokens
//                                   together, from a routing trace.
//   choose_replicas()               token -> replica choice used by the layer runtime.
//   LoadRecorder, rebalance_gate()  load statistics and the "is it worth it" gate.
//
// Loads are `weight[l][e]` >= 0, one row per layer (token counts or a moving average). A
// replica of expert e carries weight[l][e] / replica_count[l][e] (tokens spread evenly over an
// expert's replicas). Balancedness of a layer is mean GPU load / max GPU load (1 is perfect;
// 1 when the layer has no load), the figure engines log.
//
// Every entry point validates its arguments first and throws moekit::Error naming the bad
// value and what was expected; nothing is returned or written then.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moekit/trace.h"

namespace moekit {

// A placement of `num_slots` slots per layer. Arrays are row-major and dense.
struct Placement {
  int num_layers = 0;
  int num_experts = 0;  // E, logical experts per layer
  int num_slots = 0;    // physical slots per layer, E + redundant, a multiple of num_gpus
  int num_groups = 1;   // expert groups (consecutive id ranges), kept whole inside a node
  int num_nodes = 1;
  int num_gpus = 1;
  int max_replicas = 1;                // largest replica_count over all layers
  std::vector<int32_t> phy2log;        // [num_layers][num_slots]: the logical expert in each slot
  std::vector<int32_t> log2phy;        // [num_layers][num_experts][max_replicas]: slots, -1 padded
  std::vector<int32_t> replica_count;  // [num_layers][num_experts], every entry >= 1

  int slots_per_gpu() const { return num_slots / num_gpus; }
  int gpus_per_node() const { return num_gpus / num_nodes; }
  int gpu_of_slot(int slot) const { return slot / slots_per_gpu(); }
  int node_of_gpu(int gpu) const { return gpu / gpus_per_node(); }
  // Hierarchical policy (groups packed to nodes first) when groups divide evenly over nodes.
  bool hierarchical() const { return num_groups % num_nodes == 0; }
  const int32_t* phy2log_row(int layer) const { return phy2log.data() + size_t(layer) * num_slots; }
  const int32_t* log2phy_row(int layer) const { return log2phy.data() + size_t(layer) * num_experts * max_replicas; }
  const int32_t* replica_count_row(int layer) const { return replica_count.data() + size_t(layer) * num_experts; }
};

// ---- The reference placement ---------------------------------------------------------------

// DeepSeek's EPLB, entry for entry (docs/eplb.md §The reference example):
// hierarchical when num_groups % num_nodes == 0,
// else the same routine with one group and one node (global). Deterministic: stable sorts,
// ties to the lowest index. Loads are compared in double precision (the reference uses
// float32, so results can differ only where two sums tie to within float32 rounding).
// log2phy[l][e][r] is the slot of replica rank r, ranks in order of creation.
// Errors: ragged rows, negative/NaN/infinite loads, num_slots not a multiple of num_gpus or
// below E, num_groups not dividing E, num_gpus not divisible by num_nodes, and sizes past
// moekit/limits.h (slots, GPUs, layers x slots; log2phy past kMaxTableEntries entries).
Placement rebalance(const std::vector<std::vector<double>>& weight, int num_slots, int num_groups, int num_nodes,
                    int num_gpus);

// A load matrix: 1 to kMaxLayers layers, rows of equal length in [1, kMaxExperts], at most
// kMaxTableEntries loads, every load finite and in [0, kMaxLoad] (so every sum stays finite).
void validate_loads(const std::vector<std::vector<double>>& weight);
// The checks rebalance() runs, for callers that validate before doing anything else.
void validate_rebalance_args(const std::vector<std::vector<double>>& weight, int num_slots, int num_groups,
                             int num_nodes, int num_gpus);

// A placement from its phy2log rows alone ([num_layers][num_slots]); replica ranks follow slot
// order. Checks every id is in [0, E), every expert has a replica and the topology is valid.
Placement placement_from_phy2log(const std::vector<int32_t>& phy2log, int num_layers, int num_experts, int num_slots,
                                 int num_groups, int num_nodes, int num_gpus);

// ---- Loads and balancedness ----------------------------------------------------------------

// Per-GPU loads under `placement`: [num_layers][num_gpus], each slot carrying
// weight[l][e] / replica_count[l][e].
std::vector<double> gpu_loads(const Placement& placement, const std::vector<std::vector<double>>& weight);
// Per-GPU loads of the identity placement without replicas ("before"): expert e on GPU
// floor(e * num_gpus / E), i.e. E/num_gpus consecutive experts per GPU when it divides.
std::vector<double> identity_gpu_loads(const std::vector<std::vector<double>>& weight, int num_gpus);
// mean / max of n loads; 1 when every load is 0.
double balancedness(const double* load, int n);

struct BalanceReport {
  int num_gpus = 0;
  std::vector<double> gpu_load_before;                                 // [L][G], identity placement, no replicas
  std::vector<double> gpu_load_after;                                  // [L][G], the placement
  std::vector<double> balancedness_before;                             // [L]
  std::vector<double> balancedness_after;                              // [L]
  double mean_balancedness_before = 0, mean_balancedness_after = 0;    // averaged over layers
  double worst_balancedness_before = 0, worst_balancedness_after = 0;  // the worst layer
};
BalanceReport balance_report(const Placement& placement, const std::vector<std::vector<double>>& weight);

// ---- Fewer moves ---------------------------------------------------------------------------

// Replicas that must be copied onto a GPU to go from `from` to `to`: per layer and GPU, the
// replicas of `to` whose expert `from` does not already hold there (multiset difference).
// Slot order inside a GPU is free. Both placements must share their shape.
int64_t count_moved_replicas(const Placement& from, const Placement& to);
// Bytes of one routed expert's weights in one layer: 3 * hidden * moe_intermediate * bpp.
double expert_bytes(const std::string& model_name_or_path);

struct MigrationResult {
  Placement placement;                  // replicas kept in their slots where possible
  int64_t replicas_moved = 0;           // count_moved_replicas(current, placement)
  int64_t fresh_replicas_moved = 0;     // count_moved_replicas(current, rebalance(weight, ...))
  double target_balancedness = 0;       // (1 - tolerance) * fresh worst-layer balancedness
  double fresh_worst_balancedness = 0;  // worst layer of the fresh rebalance
  double worst_balancedness = 0;        // worst layer of `placement`
  std::vector<int> replicas_moved_per_layer;
};

// Given the `current` placement (same shape and topology) and new loads, find a placement
// whose worst-layer balancedness is >= (1 - tolerance) x that of a fresh rebalance(),
// moving few replicas. With per_layer_target (the default) every layer l also keeps
// balancedness >= (1 - tolerance) x the fresh layer's: a step sums the layers' times, so
// letting good layers sink to the worst layer's figure would slow the step; without it only
// the worst layer is held (fewer moves). Per layer, of the candidates that meet the target
// it keeps the one copying the fewest replicas: the current layer unchanged; a greedy repair
// of it (swaps between GPUs, re-purposing a surplus replica; each step takes the move that
// removes the most load above the cap per replica copied); in hierarchical mode the same
// repair after swapping a few groups between nodes; and the fresh layer, as is or relabelled
// node-to-node and GPU-to-GPU for the most overlap. So it never moves more than a fresh
// rebalance. Kept replicas stay in their slots; groups stay inside nodes when hierarchical.
MigrationResult rebalance_with_fewer_moves(const std::vector<std::vector<double>>& weight, const Placement& current,
                                           double tolerance = 0.01, bool per_layer_target = true);

// ---- Replica choice per token --------------------------------------------------------------

// Maps logical topk_idx [num_tokens][topk] of one layer to physical slots topk_slot (same
// shape). Token t of the num_tokens tokens lives on rank floor(t * num_gpus / num_tokens),
// which is t / (num_tokens / num_gpus) when num_gpus divides num_tokens (trace.h), and rank r
// is GPU r. For each (t, e):
//   1. a replica of e on the token's own GPU if there is one (several: the hash below picks);
//   2. else replica number hash(seed, first_token + t, e) mod replica_count[e] in log2phy
//      order, which spreads a hot expert's off-GPU tokens evenly over its replicas.
// The hash is splitmix64 of (seed, global token index t, e), so the result is a pure
// function of (placement, layer, topk_idx, seed): every rank computes the same choice for the
// same token. topk_idx entries equal to -1 (dropped) map to -1; any other id outside [0, E)
// is an Error, raised before any slot is written. The own-GPU preference means a replica
// serves its GPU's tokens plus its share of the others, not exactly 1/replica_count.
void choose_replicas(const Placement& placement, int layer, const int32_t* topk_idx, int num_tokens, int topk,
                     uint64_t seed, int32_t* topk_slot);
// One rank's tokens, as the layer runtime maps them: `num_local` tokens living on GPU `rank`,
// with global indices first_token .. first_token + num_local - 1 (the hash uses the global
// index). Gives the same slots as choose_replicas() over all tokens of the step.
void choose_replicas_for_rank(const Placement& placement, int layer, int rank, const int32_t* topk_idx, int num_local,
                              int topk, int64_t first_token, uint64_t seed, int32_t* topk_slot);

// ---- Both barrier loads from a routing trace -----------------------------------------------

struct DualLoads {
  int num_gpus = 0;
  std::vector<int64_t> gemm_rows;    // [L][G]: token-expert pairs served by the GPU
  std::vector<int64_t> recv_tokens;  // [L][G]: distinct (step, token) sent to the GPU (de-duplicated)
};
// Routes every token of `trace` with choose_replicas(seed), per step, and counts both loads.
// Tokens sent to their own GPU count as received too (the dispatch buffer holds them).
DualLoads dual_loads(const Placement& placement, const RoutingTrace& trace, uint64_t seed = 0);
// Expert counts of a trace, summed over steps: [L][E].
std::vector<std::vector<double>> trace_loads(const RoutingTrace& trace);

struct DualResult {
  Placement placement;         // balances both loads
  Placement counts_placement;  // rebalance(trace_loads(trace), ...): packing by counts alone
  DualLoads loads, counts_loads;
  // Worse of the two per-layer imbalances, max over layers: max(max rows / mean rows,
  // max recv / mean recv of the counts placement). Both sides use the same normalisers.
  double worst_imbalance = 0, counts_worst_imbalance = 0;
};
// Starts from the counts-only reference placement, then swaps slots between GPUs (inside a
// node when hierarchical; replica counts kept) while the larger of the two normalised
// per-GPU loads, max_g max(rows_g / mean_rows, recv_g / mean_recv_counts), goes down. With
// balance_recv, never worse than the counts-only placement on that figure. balance_recv = false runs the same
// search on rows alone (routed exactly), to tell the two effects apart.
DualResult rebalance_dual(const RoutingTrace& trace, int num_slots, int num_groups, int num_nodes, int num_gpus,
                          uint64_t seed = 0, bool balance_recv = true);

// ---- Statistics and the gate ---------------------------------------------------------------

// Accumulates top-k indices per layer per step into a load matrix. Two modes:
//   window(N): loads are the counts of the last N closed steps (N >= 1), as SGLang/vLLM do;
//   decay(a):  loads <- a * loads + step counts at every closed step (0 < a < 1).
// record() adds to the open step; end_step() closes it. loads() covers the closed steps only.
class LoadRecorder {
 public:
  static LoadRecorder window(int num_layers, int num_experts, int num_steps);
  static LoadRecorder decay(int num_layers, int num_experts, double factor);

  void record(int layer, const int32_t* topk_idx, int num_tokens, int topk);  // -1 ids are skipped
  // Adds per-expert token counts [E] to the open step (what the GPU layer's
  // take_expert_counts() returns); every count must be >= 0.
  void record_counts(int layer, const int64_t* counts);
  void end_step();
  std::vector<std::vector<double>> loads() const;  // [L][E]
  int num_steps_recorded() const { return steps_; }
  int num_experts() const { return num_experts_; }

 private:
  LoadRecorder(int num_layers, int num_experts, int window, double factor);
  int num_layers_, num_experts_, window_;
  double factor_;
  int steps_ = 0;
  std::vector<int64_t> open_;  // [L][E], the open step
  std::vector<int64_t> ring_;  // [window][L][E] (window mode)
  std::vector<double> total_;  // [L][E]: window sum or decayed sum
};

struct GateDecision {
  double s0 = 1;             // sum over layers of max GPU load / sum of mean loads, current placement
  double s1 = 1;             // the same for the candidate placement
  double layer_speedup = 1;  // S0 / S1
  double end_to_end = 1;     // 1 / (f / (S0/S1) + 1 - f), docs/theory.md §EPLB gain
  bool rebalance = false;    // end_to_end >= 1 + min_gain
};
// The gain of docs/theory.md §EPLB gain for speed-up s0/s1 and balanceable share f in [0, 1].
double end_to_end_gain(double layer_speedup, double balanceable_share);
// Predicts the gain of moving from `current` to `candidate` under `weight`; a layer's time is
// its busiest GPU's, so S sums the per-layer maxima over the summed means. Skip when the
// predicted end-to-end gain is below 1 + min_gain.
GateDecision rebalance_gate(const std::vector<std::vector<double>>& weight, const Placement& current,
                            const Placement& candidate, double balanceable_share, double min_gain);

// ---- Files ---------------------------------------------------------------------------------

// Loads from JSON {"layers": [[...], ...]} or CSV (one line per layer, comma separated; blank
// lines and lines starting with '#' skipped). JSON is recognised by a leading '{'. Errors name
// the layer, expert and value (negative, NaN, missing, ragged rows).
std::vector<std::vector<double>> read_loads(const std::string& path);
// A placement JSON as `moekit eplb` writes it: "phy2log" ([L][slots]), "num_experts",
// "num_groups", "num_nodes", "num_gpus" are required; "log2phy", when present, is kept (so
// replica ranks survive a round trip) after checking it lists exactly each expert's slots.
Placement read_placement(const std::string& path);

}  // namespace moekit
