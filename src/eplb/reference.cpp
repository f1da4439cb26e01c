// The reference EPLB placement (DeepSeek's eplb.py, as docs/eplb.md §The reference algorithm (exact)
// describes it), in plain loops.
// Two greedy primitives (balanced packing, replication) composed by the hierarchical policy;
// the global policy is the same routine with one group and one node.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <queue>
#include <utility>

#include "eplb/internal.h"
#include "moekit/check.h"
#include "moekit/eplb.h"
#include "moekit/limits.h"

namespace moekit {
namespace eplb_detail {

void balanced_packing(const double* weight, int num_items, int num_packs, int* pack, int* rank) {
  const int per_pack = num_items / num_packs;
  if (per_pack == 1) {
    for (int i = 0; i < num_items; ++i) pack[i] = i, rank[i] = 0;
    return;
  }
  std::vector<int> order(num_items);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return weight[a] > weight[b]; });
  // The lightest non-full pack, ties to the lowest index: a min-heap on (weight, index) that
  // drops a pack once it is full (same choice as a linear scan, O(log packs) per item).
  using Pack = std::pair<double, int>;
  std::priority_queue<Pack, std::vector<Pack>, std::greater<Pack>> open;
  for (int p = 0; p < num_packs; ++p) open.push({0.0, p});
  std::vector<int> pack_items(num_packs, 0);
  for (int item : order) {
    auto [w, best] = open.top();
    open.pop();
    pack[item] = best;
    rank[item] = pack_items[best]++;
    if (pack_items[best] < per_pack) open.push({w + weight[item], best});
  }
}

void replicate(const double* weight, int num_log, int num_phy, int* phy2log, int* rank, int* count) {
  std::vector<double> share(weight, weight + num_log);  // weight / count, kept up to date
  for (int i = 0; i < num_log; ++i) phy2log[i] = i, rank[i] = 0, count[i] = 1;
  for (int p = num_log; p < num_phy; ++p) {
    const int best = int(std::max_element(share.begin(), share.end()) - share.begin());  // first maximum
    phy2log[p] = best;
    rank[p] = count[best]++;
    share[best] = weight[best] / count[best];
  }
}

// One layer of the hierarchical policy. Writes phy2log[num_slots], phy_rank[num_slots],
// count[E]. `w` is the layer's loads.
void rebalance_layer(const double* w, int num_experts, int num_slots, int num_groups, int num_nodes, int num_gpus,
                     int32_t* phy2log, int32_t* phy_rank, int32_t* count) {
  const int group_size = num_experts / num_groups;
  const int groups_per_node = num_groups / num_nodes;
  const int experts_per_node = num_experts / num_nodes;
  const int slots_per_node = num_slots / num_nodes;
  const int gpus_per_node = num_gpus / num_nodes;
  const int slots_per_gpu = num_slots / num_gpus;

  // 1. Groups to nodes; a group packed into node n at rank r becomes meta-group
  //    n * groups_per_node + r. mlog2log undoes the relabelling.
  std::vector<double> group_load(num_groups, 0.0);
  for (int e = 0; e < num_experts; ++e) group_load[e / group_size] += w[e];
  std::vector<int> group_pack(num_groups), group_rank(num_groups);
  balanced_packing(group_load.data(), num_groups, num_nodes, group_pack.data(), group_rank.data());
  std::vector<int> mlog2log(num_experts);
  for (int e = 0; e < num_experts; ++e) {
    int g = e / group_size;
    mlog2log[(group_pack[g] * groups_per_node + group_rank[g]) * group_size + e % group_size] = e;
  }

  std::vector<double> node_w(experts_per_node), slot_load(slots_per_node);
  std::vector<int> node_phy2mlog(slots_per_node), node_rank(slots_per_node), node_count(experts_per_node);
  std::vector<int> gpu_pack(slots_per_node), gpu_rank(slots_per_node);
  for (int n = 0; n < num_nodes; ++n) {
    const int* node_log = mlog2log.data() + n * experts_per_node;
    // 2. Replicate inside the node, in relabelled order.
    for (int i = 0; i < experts_per_node; ++i) node_w[i] = w[node_log[i]];
    replicate(node_w.data(), experts_per_node, slots_per_node, node_phy2mlog.data(), node_rank.data(),
              node_count.data());
    // 3. Slots to GPUs, each slot carrying its expert's load over its replica count.
    for (int j = 0; j < slots_per_node; ++j) slot_load[j] = node_w[node_phy2mlog[j]] / node_count[node_phy2mlog[j]];
    balanced_packing(slot_load.data(), slots_per_node, gpus_per_node, gpu_pack.data(), gpu_rank.data());
    // 4. Back to original ids.
    for (int j = 0; j < slots_per_node; ++j) {
      int slot = n * slots_per_node + gpu_pack[j] * slots_per_gpu + gpu_rank[j];
      phy2log[slot] = node_log[node_phy2mlog[j]];
      phy_rank[slot] = node_rank[j];
    }
    for (int i = 0; i < experts_per_node; ++i) count[node_log[i]] = node_count[i];
  }
}

}  // namespace eplb_detail

void validate_loads(const std::vector<std::vector<double>>& weight) {
  MOEKIT_CHECK(!weight.empty(), "eplb: the load matrix has no layers");
  const size_t num_experts = weight[0].size();
  MOEKIT_CHECK(num_experts > 0, "eplb: layer 0 has no expert loads");
  MOEKIT_CHECK(weight.size() <= size_t(kMaxLayers) && num_experts <= size_t(kMaxExperts) &&
                   weight.size() * num_experts <= size_t(kMaxTableEntries),
               fmt::format("eplb: {} layers x {} experts exceed the limits ({} layers, {} experts, {} entries)",
                           weight.size(), num_experts, kMaxLayers, kMaxExperts, kMaxTableEntries));
  for (size_t l = 0; l < weight.size(); ++l) {
    MOEKIT_CHECK(
        weight[l].size() == num_experts,
        fmt::format("eplb: layer {} has {} loads but layer 0 has {} (ragged rows)", l, weight[l].size(), num_experts));
    for (size_t e = 0; e < num_experts; ++e) {
      double v = weight[l][e];
      MOEKIT_CHECK(std::isfinite(v) && v >= 0 && v <= kMaxLoad,
                   fmt::format("eplb: load of layer {} expert {} is {}, expected a finite value in [0, {}]", l, e, v,
                               kMaxLoad));
    }
  }
}

void validate_rebalance_args(const std::vector<std::vector<double>>& weight, int num_slots, int num_groups,
                             int num_nodes, int num_gpus) {
  validate_loads(weight);
  const int E = int(weight[0].size());
  MOEKIT_CHECK(num_gpus > 0, fmt::format("eplb: num_gpus = {} must be > 0", num_gpus));
  MOEKIT_CHECK(num_nodes > 0, fmt::format("eplb: num_nodes = {} must be > 0", num_nodes));
  MOEKIT_CHECK(num_gpus % num_nodes == 0,
               fmt::format("eplb: num_gpus = {} is not divisible by num_nodes = {}", num_gpus, num_nodes));
  MOEKIT_CHECK(num_gpus <= kMaxRanks, fmt::format("eplb: num_gpus = {} exceeds the limit of {}", num_gpus, kMaxRanks));
  MOEKIT_CHECK(num_slots > 0 && num_slots % num_gpus == 0,
               fmt::format("eplb: num_slots = {} must be a positive multiple of num_gpus = {}", num_slots, num_gpus));
  MOEKIT_CHECK(num_slots <= kMaxSlots, fmt::format("eplb: num_slots = {} exceeds the limit of {}", num_slots, kMaxSlots));
  MOEKIT_CHECK(int64_t(weight.size()) * num_slots <= kMaxTableEntries,
               fmt::format("eplb: {} layers x {} slots exceed the limit of {} placement entries", weight.size(),
                           num_slots, kMaxTableEntries));
  MOEKIT_CHECK(num_slots >= E,
               fmt::format("eplb: num_slots = {} is below the {} experts: every expert needs a slot", num_slots, E));
  MOEKIT_CHECK(num_groups > 0 && E % num_groups == 0,
               fmt::format("eplb: num_groups = {} must divide the {} experts", num_groups, E));
}

Placement rebalance(const std::vector<std::vector<double>>& weight, int num_slots, int num_groups, int num_nodes,
                    int num_gpus) {
  validate_rebalance_args(weight, num_slots, num_groups, num_nodes, num_gpus);
  const int L = int(weight.size()), E = int(weight[0].size());
  const bool hierarchical = num_groups % num_nodes == 0;
  std::vector<int32_t> phy2log(size_t(L) * num_slots), phy_rank(size_t(L) * num_slots);
  std::vector<int32_t> count(size_t(L) * E);
  for (int l = 0; l < L; ++l)
    eplb_detail::rebalance_layer(weight[l].data(), E, num_slots, hierarchical ? num_groups : 1,
                                 hierarchical ? num_nodes : 1, num_gpus, &phy2log[size_t(l) * num_slots],
                                 &phy_rank[size_t(l) * num_slots], &count[size_t(l) * E]);
  return eplb_detail::assemble(std::move(phy2log), phy_rank, std::move(count), L, E, num_slots, num_groups, num_nodes,
                               num_gpus);
}

}  // namespace moekit
