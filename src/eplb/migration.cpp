// Fewer moves: a placement within a tolerance of a fresh rebalance that keeps most replicas
// where they already are (see rebalance_with_fewer_moves in include/moekit/eplb.h).
//
// A fresh rebalance ignores where the weights are: its greedy order reshuffles almost every
// slot even when the loads barely moved, and moving one DeepSeek-V3 expert is 44 MB per
// layer. Per layer we take the placement that meets the balancedness target with the fewest
// replicas copied among: the current one (kept when it meets the target), greedy repairs of
// it (in place, or after moving a few groups between nodes in hierarchical mode), and the
// fresh one, also relabelled (nodes, then GPUs) to overlap the current one the most.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "eplb/internal.h"
#include "moekit/check.h"
#include "moekit/eplb.h"

namespace moekit {
namespace {

// Greedy maximum-overlap matching of n new blocks to n old blocks (largest overlap first,
// ties to the lowest indices): returns match[new] = old.
std::vector<int> match_blocks(const int32_t* fresh, const int32_t* old, int n, int block) {
  std::vector<std::vector<int32_t>> fs(n), os(n);
  for (int i = 0; i < n; ++i)
    fs[i] = eplb_detail::sorted_range(fresh + i * block, block),
    os[i] = eplb_detail::sorted_range(old + i * block, block);
  struct Pair {
    int overlap, a, b;
  };
  std::vector<Pair> pairs;
  pairs.reserve(size_t(n) * n);
  for (int a = 0; a < n; ++a)
    for (int b = 0; b < n; ++b) pairs.push_back({eplb_detail::sorted_overlap(fs[a], os[b]), a, b});
  std::stable_sort(pairs.begin(), pairs.end(), [](const Pair& x, const Pair& y) { return x.overlap > y.overlap; });
  std::vector<int> match(n, -1);
  std::vector<char> taken(n, 0);
  for (const Pair& p : pairs)
    if (match[p.a] < 0 && !taken[p.b]) match[p.a] = p.b, taken[p.b] = 1;
  return match;
}

// Writes the multiset `items` into `out[0..n)`, keeping every expert that `old` already has at
// the same position, so a kept replica is neither copied nor moved inside the GPU.
void place_keeping(const int32_t* old, std::vector<int32_t> items, int n, int32_t* out) {
  std::vector<char> filled(n, 0);
  for (int k = 0; k < n; ++k) {
    auto it = std::find(items.begin(), items.end(), old[k]);
    if (it != items.end()) out[k] = old[k], filled[k] = 1, items.erase(it);
  }
  size_t next = 0;
  for (int k = 0; k < n; ++k)
    if (!filled[k]) out[k] = items[next++];
}

// The fresh layer relabelled onto the old one: nodes to nodes (hierarchical only, so groups
// stay inside a node), GPUs to GPUs inside matched nodes, slots kept in place inside GPUs.
std::vector<int32_t> align_to(const int32_t* old, const int32_t* fresh, const Placement& shape) {
  const int S = shape.num_slots, per_gpu = shape.slots_per_gpu();
  const int nodes = shape.hierarchical() ? shape.num_nodes : 1;
  const int per_node = S / nodes, gpus_per_node = shape.num_gpus / nodes;
  std::vector<int> node_match = match_blocks(fresh, old, nodes, per_node);
  std::vector<int32_t> out(S);
  for (int a = 0; a < nodes; ++a) {
    const int32_t* f = fresh + a * per_node;
    const int32_t* o = old + node_match[a] * per_node;
    int32_t* dst = out.data() + node_match[a] * per_node;
    std::vector<int> gpu_match = match_blocks(f, o, gpus_per_node, per_gpu);
    for (int g = 0; g < gpus_per_node; ++g) {
      const int b = gpu_match[g];
      place_keeping(o + b * per_gpu, std::vector<int32_t>(f + g * per_gpu, f + (g + 1) * per_gpu), per_gpu,
                    dst + b * per_gpu);
    }
  }
  return out;
}

// Does every group keep all its replicas inside one node?
bool groups_inside_nodes(const std::vector<int32_t>& slot, const Placement& shape) {
  const int group_size = shape.num_experts / shape.num_groups, per_node = shape.num_slots / shape.num_nodes;
  std::vector<int> node_of_group(shape.num_groups, -1);
  for (int s = 0; s < shape.num_slots; ++s) {
    int& n = node_of_group[slot[s] / group_size];
    if (n >= 0 && n != s / per_node) return false;
    n = s / per_node;
  }
  return true;
}

// Greedy repair of one layer towards max GPU load <= cap. Each step looks at the busiest GPU
// g and takes the move that removes the most load above the cap per replica copied:
//   swap:      exchange a slot of g with a slot of another GPU (2 replicas copied);
//   replicate: turn a surplus replica (its expert keeps >= 1) anywhere into one more replica
//              of an expert on g, which lowers that expert's share everywhere (1 copied).
// Moves stay inside g's node in hierarchical mode. Returns false if it gets stuck.
class Repair {
 public:
  Repair(const Placement& shape, const double* w, std::vector<int32_t> slot, double cap)
      : shape_(shape), w_(w), slot_(std::move(slot)), cap_(cap), count_(shape.num_experts, 0) {
    for (int32_t e : slot_) ++count_[e];
    load_.resize(shape.num_gpus);
    eplb_detail::layer_gpu_loads(slot_.data(), count_.data(), w_, shape.num_slots, shape.num_gpus, load_.data());
  }

  bool run() {
    const double total = std::accumulate(load_.begin(), load_.end(), 0.0);
    const double eps = 1e-12 * std::max(total, 1.0);
    for (int iter = 0; iter < 4 * shape_.num_slots; ++iter) {
      const int g = int(std::max_element(load_.begin(), load_.end()) - load_.begin());
      if (load_[g] <= cap_ + eps) return true;
      Move best = best_move(g);
      if (best.gain <= eps) return false;
      apply(best);
    }
    return false;
  }
  const std::vector<int32_t>& slots() const { return slot_; }

 private:
  struct Move {
    double gain = 0;  // excess removed per replica copied
    int s1 = -1, s2 = -1;
    bool swap = false;
  };

  double excess(double load) const { return std::max(0.0, load - cap_); }
  double share(int e) const { return w_[e] / count_[e]; }
  int gpu(int s) const { return s / shape_.slots_per_gpu(); }
  bool allowed(int g, int h) const { return !shape_.hierarchical() || shape_.node_of_gpu(g) == shape_.node_of_gpu(h); }

  Move best_move(int g) {
    const int per_gpu = shape_.slots_per_gpu();
    const double base = total_excess(load_);
    Move best;
    std::vector<double> trial(load_.size());
    for (int s1 = g * per_gpu; s1 < (g + 1) * per_gpu; ++s1) {
      const int a = slot_[s1];
      for (int s2 = 0; s2 < shape_.num_slots; ++s2) {
        const int h = gpu(s2), b = slot_[s2];
        if (!allowed(g, h) || b == a) continue;
        if (h != g) {  // swap a (on g) with b (on h)
          const double delta = share(a) - share(b);
          if (delta > 0) {
            const double gain =
                (excess(load_[g]) + excess(load_[h]) - excess(load_[g] - delta) - excess(load_[h] + delta)) / 2;
            if (gain > best.gain) best = {gain, s1, s2, true};
          }
        }
        if (count_[b] >= 2) {  // slot s2 becomes another replica of a
          trial = load_;
          replicate_loads(a, s2, trial);
          const double gain = base - total_excess(trial);
          if (gain > best.gain) best = {gain, s1, s2, false};
        }
      }
    }
    return best;
  }

  // Loads after slot s2 (holding b, count >= 2) becomes one more replica of a.
  void replicate_loads(int a, int s2, std::vector<double>& load) const {
    const int b = slot_[s2];
    const double a_old = share(a), a_new = w_[a] / (count_[a] + 1);
    const double b_old = share(b), b_new = w_[b] / (count_[b] - 1);
    for (int s = 0; s < shape_.num_slots; ++s) {
      if (s == s2)
        load[gpu(s)] += a_new - b_old;
      else if (slot_[s] == a)
        load[gpu(s)] += a_new - a_old;
      else if (slot_[s] == b)
        load[gpu(s)] += b_new - b_old;
    }
  }

  double total_excess(const std::vector<double>& load) const {
    double sum = 0;
    for (double x : load) sum += excess(x);
    return sum;
  }

  void apply(const Move& m) {
    if (m.swap) {
      std::swap(slot_[m.s1], slot_[m.s2]);
    } else {
      const int a = slot_[m.s1], b = slot_[m.s2];
      slot_[m.s2] = a;
      ++count_[a], --count_[b];
    }
    eplb_detail::layer_gpu_loads(slot_.data(), count_.data(), w_, shape_.num_slots, shape_.num_gpus, load_.data());
  }

  const Placement& shape_;
  const double* w_;
  std::vector<int32_t> slot_;
  double cap_;
  std::vector<int32_t> count_;
  std::vector<double> load_;
};

// The node of every group in a hierarchical layer.
std::vector<int> node_of_groups(const int32_t* slot, const Placement& shape) {
  std::vector<int> node(shape.num_groups);
  const int group_size = shape.num_experts / shape.num_groups, per_node = shape.num_slots / shape.num_nodes;
  for (int s = 0; s < shape.num_slots; ++s) node[slot[s] / group_size] = s / per_node;
  return node;
}

// Group-to-node assignments to try when node totals, not GPUs, are out of balance: starting
// from the current one, swap the pair of groups (busiest node <-> another) that lowers the
// largest node total the most, one swap at a time; then the fresh placement's assignment
// with its nodes matched to the current ones for the most overlap.
std::vector<std::vector<int>> node_assignments(const int32_t* old, const int32_t* fresh, const Placement& shape,
                                               const double* w) {
  const int nodes = shape.num_nodes, group_size = shape.num_experts / shape.num_groups;
  std::vector<double> group_load(shape.num_groups, 0.0);
  for (int e = 0; e < shape.num_experts; ++e) group_load[e / group_size] += w[e];
  std::vector<int> assign = node_of_groups(old, shape);
  std::vector<std::vector<int>> out;
  for (int step = 0; step < shape.num_groups; ++step) {
    std::vector<double> total(nodes, 0.0);
    for (int g = 0; g < shape.num_groups; ++g) total[assign[g]] += group_load[g];
    const int hot = int(std::max_element(total.begin(), total.end()) - total.begin());
    double best_max = total[hot];
    int ba = -1, bb = -1;
    for (int a = 0; a < shape.num_groups; ++a)
      for (int b = 0; b < shape.num_groups; ++b) {
        if (assign[a] != hot || assign[b] == hot) continue;
        const double d = group_load[a] - group_load[b];
        double mx = std::max(total[hot] - d, total[assign[b]] + d);
        for (int n = 0; n < nodes; ++n)
          if (n != hot && n != assign[b]) mx = std::max(mx, total[n]);
        if (mx < best_max) best_max = mx, ba = a, bb = b;
      }
    if (ba < 0) break;
    std::swap(assign[ba], assign[bb]);
    out.push_back(assign);
  }
  const int per_node = shape.num_slots / nodes;
  const std::vector<int> node_match = match_blocks(fresh, old, nodes, per_node);
  std::vector<int> fresh_assign = node_of_groups(fresh, shape);
  for (int& n : fresh_assign) n = node_match[n];
  out.push_back(fresh_assign);
  return out;
}

// The current layer with groups moved to the nodes `target` gives them. Replicas of staying
// groups keep their slots; slots of departing groups (and, if short, surplus replicas with
// the smallest load per replica) take the arriving experts, heaviest first onto the lightest
// GPU; slots left over become replicas of the largest load per replica.
std::vector<int32_t> regroup(const int32_t* old, const std::vector<int>& target, const Placement& shape,
                             const double* w) {
  const int S = shape.num_slots, nodes = shape.num_nodes, per_node = S / nodes, per_gpu = shape.slots_per_gpu();
  const int group_size = shape.num_experts / shape.num_groups;

  std::vector<int32_t> slot(old, old + S);
  std::vector<int> count(shape.num_experts, 0);
  std::vector<double> load(shape.num_gpus, 0.0);
  for (int s = 0; s < S; ++s)
    if (target[slot[s] / group_size] != s / per_node)
      slot[s] = -1;  // departing
    else
      ++count[slot[s]];
  auto share = [&](int e) { return w[e] / std::max(1, count[e]); };
  for (int n = 0; n < nodes; ++n) {
    const int begin = n * per_node, end = begin + per_node;
    std::vector<int> arriving;
    for (int e = 0; e < shape.num_experts; ++e)
      if (target[e / group_size] == n && count[e] == 0) arriving.push_back(e);
    int num_free = int(std::count(slot.begin() + begin, slot.begin() + end, -1));
    while (num_free < int(arriving.size())) {  // free the surplus replica that carries the least
      int victim = -1;
      for (int s = begin; s < end; ++s)
        if (slot[s] >= 0 && count[slot[s]] >= 2 && (victim < 0 || share(slot[s]) < share(slot[victim]))) victim = s;
      --count[slot[victim]], slot[victim] = -1, ++num_free;
    }
    std::stable_sort(arriving.begin(), arriving.end(), [&](int a, int b) { return w[a] > w[b]; });
    for (int e : arriving) count[e] = 1;
    // Fill the rest with extra replicas of the node's largest load per replica.
    for (int extra = num_free - int(arriving.size()); extra > 0; --extra) {
      int best = -1;
      for (int e = 0; e < shape.num_experts; ++e)
        if (target[e / group_size] == n && (best < 0 || w[e] / count[e] > w[best] / count[best])) best = e;
      arriving.push_back(best);
      ++count[best];
    }
    for (int s = begin; s < end; ++s)
      if (slot[s] >= 0) load[s / per_gpu] += share(slot[s]);
    for (int e : arriving) {
      int pick = -1;
      for (int s = begin; s < end; ++s)
        if (slot[s] < 0 && (pick < 0 || load[s / per_gpu] < load[pick / per_gpu])) pick = s;
      slot[pick] = e;
      load[pick / per_gpu] += share(e);
    }
  }
  return slot;
}

}  // namespace

MigrationResult rebalance_with_fewer_moves(const std::vector<std::vector<double>>& weight, const Placement& current,
                                           double tolerance, bool per_layer_target) {
  MOEKIT_CHECK(tolerance >= 0 && tolerance < 1,
               fmt::format("rebalance_with_fewer_moves: tolerance = {} must be in [0, 1)", tolerance));
  validate_rebalance_args(weight, current.num_slots, current.num_groups, current.num_nodes, current.num_gpus);
  MOEKIT_CHECK(
      int(weight.size()) == current.num_layers && int(weight[0].size()) == current.num_experts,
      fmt::format("rebalance_with_fewer_moves: loads are {} layers x {} experts, the current placement {} x {}",
                  weight.size(), weight[0].size(), current.num_layers, current.num_experts));
  MOEKIT_CHECK(current.phy2log.size() == size_t(current.num_layers) * current.num_slots,
               "rebalance_with_fewer_moves: the current placement's phy2log does not match its shape");

  const Placement fresh = rebalance(weight, current.num_slots, current.num_groups, current.num_nodes, current.num_gpus);
  const BalanceReport fresh_report = balance_report(fresh, weight);
  MigrationResult r;
  r.fresh_worst_balancedness = fresh_report.worst_balancedness_after;
  r.target_balancedness = (1.0 - tolerance) * r.fresh_worst_balancedness;
  r.fresh_replicas_moved = count_moved_replicas(current, fresh);

  const int S = current.num_slots, G = current.num_gpus, per_gpu = current.slots_per_gpu();
  std::vector<int32_t> phy2log(size_t(current.num_layers) * S);
  for (int l = 0; l < current.num_layers; ++l) {
    const int32_t* old = current.phy2log_row(l);
    const double total = std::accumulate(weight[l].begin(), weight[l].end(), 0.0);
    // Each layer's busiest GPU sets that layer's time and a step sums the layers, so by default
    // every layer stays within the tolerance of its fresh balancedness; with a worst-layer
    // target a layer may fall to the fresh worst layer's figure.
    const double layer_target =
        per_layer_target ? (1.0 - tolerance) * fresh_report.balancedness_after[l] : r.target_balancedness;
    const double cap = layer_target > 0 ? total / G / layer_target : 0.0;

    // The fresh layer as is, or relabelled for overlap (greedy matching, so check both).
    std::vector<int32_t> best(fresh.phy2log_row(l), fresh.phy2log_row(l) + S);
    int best_moves = eplb_detail::layer_moves(old, best.data(), G, per_gpu);
    std::vector<int32_t> aligned = align_to(old, fresh.phy2log_row(l), current);
    if (const int moves = eplb_detail::layer_moves(old, aligned.data(), G, per_gpu); moves < best_moves)
      best = std::move(aligned), best_moves = moves;
    // Candidates: the current layer repaired in place, and (hierarchical) the current layer
    // with groups first moved to the fresh node assignment, then repaired.
    std::vector<std::vector<int32_t>> starts;
    if (!current.hierarchical() || groups_inside_nodes(std::vector<int32_t>(old, old + S), current))
      starts.emplace_back(old, old + S);
    if (current.hierarchical())
      for (const auto& target : node_assignments(old, fresh.phy2log_row(l), current, weight[l].data()))
        starts.push_back(regroup(old, target, current, weight[l].data()));
    for (auto& start : starts) {
      // A start that already moves more than the best found cannot win.
      if (eplb_detail::layer_moves(old, start.data(), G, per_gpu) >= best_moves) continue;
      Repair repair(current, weight[l].data(), std::move(start), cap);
      if (!repair.run()) continue;
      const int moves = eplb_detail::layer_moves(old, repair.slots().data(), G, per_gpu);
      if (moves < best_moves) best = repair.slots(), best_moves = moves;
    }
    // Kept replicas stay in their slots (repair swaps can bring an expert back to its GPU in
    // another slot; the raw fresh layer ignores slots altogether).
    for (int g = 0; g < G; ++g)
      place_keeping(old + g * per_gpu,
                    std::vector<int32_t>(best.begin() + g * per_gpu, best.begin() + (g + 1) * per_gpu), per_gpu,
                    &phy2log[size_t(l) * S + g * per_gpu]);
    r.replicas_moved_per_layer.push_back(best_moves);
    r.replicas_moved += best_moves;
  }
  r.placement = placement_from_phy2log(phy2log, current.num_layers, current.num_experts, S, current.num_groups,
                                       current.num_nodes, G);
  r.worst_balancedness = balance_report(r.placement, weight).worst_balancedness_after;
  return r;
}

}  // namespace moekit
