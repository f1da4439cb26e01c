// Helpers shared by the eplb sources (not a public header).
#pragma once

#include <cstdint>
#include <vector>

#include "moekit/eplb.h"

namespace moekit::eplb_detail {

// Greedy balanced packing of num_items into num_packs packs of num_items/num_packs items:
// heaviest first (stable), each to the lightest non-full pack (lowest index on ties).
void balanced_packing(const double* weight, int num_items, int num_packs, int* pack, int* rank);
// Replication of num_log experts into num_phy >= num_log slots: slots 0..num_log-1 hold
// experts 0..num_log-1; each further slot goes to the largest weight/count (lowest index).
void replicate(const double* weight, int num_log, int num_phy, int* phy2log, int* rank, int* count);
// One layer of the reference hierarchical policy (pass 1 group, 1 node for the global one).
void rebalance_layer(const double* w, int num_experts, int num_slots, int num_groups, int num_nodes, int num_gpus,
                     int32_t* phy2log, int32_t* phy_rank, int32_t* count);

// Builds a Placement (log2phy from the replica ranks) from its flat arrays.
Placement assemble(std::vector<int32_t> phy2log, const std::vector<int32_t>& phy_rank, std::vector<int32_t> count,
                   int num_layers, int num_experts, int num_slots, int num_groups, int num_nodes, int num_gpus);

// Per-GPU loads of one layer: out[num_gpus], each slot carrying w[e] / count[e].
void layer_gpu_loads(const int32_t* phy2log, const int32_t* count, const double* w, int num_slots, int num_gpus,
                     double* out);

// The n ids at `begin`, sorted: a GPU's or node's contents as a multiset.
std::vector<int32_t> sorted_range(const int32_t* begin, int n);
// Replicas copied onto GPUs going from layer `old` to layer `now` (per-GPU multiset difference).
int layer_moves(const int32_t* old, const int32_t* now, int num_gpus, int per_gpu);

// |a ∩ b| of two multisets given as sorted vectors.
inline int sorted_overlap(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t i = 0, j = 0;
  int common = 0;
  while (i < a.size() && j < b.size()) {
    if (a[i] == b[j]) {
      ++common, ++i, ++j;
    } else if (a[i] < b[j]) {
      ++i;
    } else {
      ++j;
    }
  }
  return common;
}

// splitmix64: a fast, well-mixed, portable hash for deterministic choices.
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The hash that spreads (token, expert) pairs over an expert's replicas.
inline uint64_t pair_hash(uint64_t seed, int64_t token, int32_t expert) {
  return splitmix64(splitmix64(seed ^ splitmix64(uint64_t(token))) ^ uint64_t(uint32_t(expert)));
}

// choose_replicas() for one pair: replicas[0..n) in order, the token on GPU `rank`; prefer a
// replica on that GPU, else replica number h mod n.
inline int32_t pick_replica(const int32_t* replicas, int n, int slots_per_gpu, int rank, uint64_t h) {
  if (n == 1) return replicas[0];
  int own = 0;
  for (int r = 0; r < n; ++r) own += replicas[r] / slots_per_gpu == rank;
  if (own == 0) return replicas[h % uint64_t(n)];
  int pick = int(h % uint64_t(own));
  for (int r = 0;; ++r)
    if (replicas[r] / slots_per_gpu == rank && pick-- == 0) return replicas[r];
}

}  // namespace moekit::eplb_detail
