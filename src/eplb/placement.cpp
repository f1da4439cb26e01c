// Placement bookkeeping: building log2phy, per-GPU loads, balancedness, counting moves.
#include <fmt/format.h>

#include <algorithm>

#include "eplb/internal.h"
#include "moekit/check.h"
#include "moekit/eplb.h"
#include "moekit/limits.h"
#include "moekit/spec.h"

namespace moekit {
namespace eplb_detail {

Placement assemble(std::vector<int32_t> phy2log, const std::vector<int32_t>& phy_rank, std::vector<int32_t> count,
                   int num_layers, int num_experts, int num_slots, int num_groups, int num_nodes, int num_gpus) {
  Placement p;
  p.num_layers = num_layers;
  p.num_experts = num_experts;
  p.num_slots = num_slots;
  p.num_groups = num_groups;
  p.num_nodes = num_nodes;
  p.num_gpus = num_gpus;
  p.max_replicas = *std::max_element(count.begin(), count.end());
  // log2phy is dense, [layers][experts][max_replicas]: one hot expert with many replicas
  // multiplies the size of the whole table.
  MOEKIT_CHECK(int64_t(num_layers) * num_experts * p.max_replicas <= kMaxTableEntries,
               fmt::format("placement: log2phy of {} layers x {} experts x {} replicas (the most of one expert) exceeds "
                           "the limit of {} entries: fewer redundant slots or layers",
                           num_layers, num_experts, p.max_replicas, kMaxTableEntries));
  p.log2phy.assign(size_t(num_layers) * num_experts * p.max_replicas, -1);
  for (int l = 0; l < num_layers; ++l)
    for (int s = 0; s < num_slots; ++s) {
      size_t i = size_t(l) * num_slots + s;
      p.log2phy[(size_t(l) * num_experts + phy2log[i]) * p.max_replicas + phy_rank[i]] = s;
    }
  p.phy2log = std::move(phy2log);
  p.replica_count = std::move(count);
  return p;
}

void layer_gpu_loads(const int32_t* phy2log, const int32_t* count, const double* w, int num_slots, int num_gpus,
                     double* out) {
  const int per_gpu = num_slots / num_gpus;
  std::fill(out, out + num_gpus, 0.0);
  for (int s = 0; s < num_slots; ++s) out[s / per_gpu] += w[phy2log[s]] / count[phy2log[s]];
}

std::vector<int32_t> sorted_range(const int32_t* begin, int n) {
  std::vector<int32_t> v(begin, begin + n);
  std::sort(v.begin(), v.end());
  return v;
}

int layer_moves(const int32_t* old, const int32_t* now, int num_gpus, int per_gpu) {
  int moved = 0;
  for (int g = 0; g < num_gpus; ++g)
    moved +=
        per_gpu - sorted_overlap(sorted_range(old + g * per_gpu, per_gpu), sorted_range(now + g * per_gpu, per_gpu));
  return moved;
}

}  // namespace eplb_detail

Placement placement_from_phy2log(const std::vector<int32_t>& phy2log, int num_layers, int num_experts, int num_slots,
                                 int num_groups, int num_nodes, int num_gpus) {
  MOEKIT_CHECK(num_layers > 0 && num_experts > 0,
               fmt::format("placement: {} layers x {} experts, expected both > 0", num_layers, num_experts));
  // The same topology rules as rebalance(), checked on a zero load matrix of this shape.
  validate_rebalance_args(std::vector<std::vector<double>>(1, std::vector<double>(num_experts, 0.0)), num_slots,
                          num_groups, num_nodes, num_gpus);
  MOEKIT_CHECK(phy2log.size() == size_t(num_layers) * num_slots,
               fmt::format("placement: phy2log holds {} entries, expected {} layers x {} slots", phy2log.size(),
                           num_layers, num_slots));
  std::vector<int32_t> count(size_t(num_layers) * num_experts, 0), rank(phy2log.size());
  for (int l = 0; l < num_layers; ++l)
    for (int s = 0; s < num_slots; ++s) {
      int32_t e = phy2log[size_t(l) * num_slots + s];
      MOEKIT_CHECK(e >= 0 && e < num_experts,
                   fmt::format("placement: layer {} slot {} holds expert {}, expected [0, {})", l, s, e, num_experts));
      rank[size_t(l) * num_slots + s] = count[size_t(l) * num_experts + e]++;
    }
  for (int l = 0; l < num_layers; ++l)
    for (int e = 0; e < num_experts; ++e)
      MOEKIT_CHECK(count[size_t(l) * num_experts + e] > 0,
                   fmt::format("placement: layer {} expert {} has no replica", l, e));
  return eplb_detail::assemble(phy2log, rank, std::move(count), num_layers, num_experts, num_slots, num_groups,
                               num_nodes, num_gpus);
}

std::vector<double> gpu_loads(const Placement& p, const std::vector<std::vector<double>>& weight) {
  MOEKIT_CHECK(int(weight.size()) == p.num_layers,
               fmt::format("gpu_loads: {} load rows for a placement of {} layers", weight.size(), p.num_layers));
  std::vector<double> out(size_t(p.num_layers) * p.num_gpus);
  for (int l = 0; l < p.num_layers; ++l) {
    MOEKIT_CHECK(
        int(weight[l].size()) == p.num_experts,
        fmt::format("gpu_loads: layer {} has {} loads, the placement {} experts", l, weight[l].size(), p.num_experts));
    eplb_detail::layer_gpu_loads(p.phy2log_row(l), p.replica_count_row(l), weight[l].data(), p.num_slots, p.num_gpus,
                                 &out[size_t(l) * p.num_gpus]);
  }
  return out;
}

std::vector<double> identity_gpu_loads(const std::vector<std::vector<double>>& weight, int num_gpus) {
  MOEKIT_CHECK(num_gpus > 0, fmt::format("identity_gpu_loads: num_gpus = {} must be > 0", num_gpus));
  std::vector<double> out(weight.size() * num_gpus, 0.0);
  for (size_t l = 0; l < weight.size(); ++l) {
    const int64_t E = int64_t(weight[l].size());
    for (int64_t e = 0; e < E; ++e) out[l * num_gpus + e * num_gpus / E] += weight[l][e];
  }
  return out;
}

double balancedness(const double* load, int n) {
  double sum = 0, max = 0;
  for (int i = 0; i < n; ++i) sum += load[i], max = std::max(max, load[i]);
  return max > 0 ? sum / n / max : 1.0;
}

BalanceReport balance_report(const Placement& p, const std::vector<std::vector<double>>& weight) {
  BalanceReport r;
  r.num_gpus = p.num_gpus;
  r.gpu_load_after = gpu_loads(p, weight);
  r.gpu_load_before = identity_gpu_loads(weight, p.num_gpus);
  r.worst_balancedness_before = r.worst_balancedness_after = 1.0;
  for (int l = 0; l < p.num_layers; ++l) {
    double before = balancedness(&r.gpu_load_before[size_t(l) * p.num_gpus], p.num_gpus);
    double after = balancedness(&r.gpu_load_after[size_t(l) * p.num_gpus], p.num_gpus);
    r.balancedness_before.push_back(before);
    r.balancedness_after.push_back(after);
    r.mean_balancedness_before += before / p.num_layers;
    r.mean_balancedness_after += after / p.num_layers;
    r.worst_balancedness_before = std::min(r.worst_balancedness_before, before);
    r.worst_balancedness_after = std::min(r.worst_balancedness_after, after);
  }
  return r;
}

int64_t count_moved_replicas(const Placement& from, const Placement& to) {
  MOEKIT_CHECK(from.num_layers == to.num_layers && from.num_experts == to.num_experts &&
                   from.num_slots == to.num_slots && from.num_gpus == to.num_gpus,
               fmt::format("count_moved_replicas: shapes differ ({}x{} experts, {} slots, {} GPUs vs {}x{}, {}, {})",
                           from.num_layers, from.num_experts, from.num_slots, from.num_gpus, to.num_layers,
                           to.num_experts, to.num_slots, to.num_gpus));
  int64_t moved = 0;
  for (int l = 0; l < from.num_layers; ++l)
    moved += eplb_detail::layer_moves(from.phy2log_row(l), to.phy2log_row(l), from.num_gpus, from.slots_per_gpu());
  return moved;
}

double expert_bytes(const std::string& model_name_or_path) {
  ModelSpec m = load_model_spec(model_name_or_path);
  MOEKIT_CHECK(m.is_moe(), fmt::format("expert_bytes: model '{}' is dense (no routed experts)", m.name));
  return m.params_per_expert() * m.weight_bytes_per_param;
}

}  // namespace moekit
