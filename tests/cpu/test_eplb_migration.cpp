// Fewer moves: after a load drift, a placement within 1% of a fresh rebalance's worst-layer
// balancedness that copies far fewer replicas. Moves are counted independently here (per GPU
// multiset difference written out in the test) and the figures are printed.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>

#include "moekit/check.h"
#include "moekit/eplb.h"

using namespace moekit;
using Loads = std::vector<std::vector<double>>;

namespace {

Loads heavy_loads(std::mt19937_64& rng, int layers, int experts) {
  std::lognormal_distribution<double> heavy(0.0, 1.0);
  Loads w(layers, std::vector<double>(experts));
  for (auto& row : w)
    for (double& v : row) v = std::round(1000 * heavy(rng));
  return w;
}

// The next window's loads: every expert drifts by a few percent, and (unless `mild`) per
// layer two hot and two cold experts trade places.
Loads drift(const Loads& w, std::mt19937_64& rng, double sigma, bool mild = false) {
  std::lognormal_distribution<double> noise(0.0, sigma);
  Loads out = w;
  for (auto& row : out) {
    for (double& v : row) v = std::round(v * noise(rng));
    if (mild) continue;
    std::vector<int> order(row.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = int(i);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return row[a] > row[b]; });
    std::swap(row[order[0]], row[order[order.size() - 1]]);
    std::swap(row[order[1]], row[order[order.size() - 2]]);
  }
  return out;
}

// Replicas that must arrive on some GPU: for every (layer, GPU, expert), new copies beyond old.
int64_t moves_by_hand(const Placement& from, const Placement& to) {
  int64_t moved = 0;
  for (int l = 0; l < from.num_layers; ++l)
    for (int g = 0; g < from.num_gpus; ++g) {
      std::map<int, int> have;
      for (int s = g * from.slots_per_gpu(); s < (g + 1) * from.slots_per_gpu(); ++s) ++have[from.phy2log_row(l)[s]];
      for (int s = g * to.slots_per_gpu(); s < (g + 1) * to.slots_per_gpu(); ++s)
        if (have[to.phy2log_row(l)[s]]-- <= 0) ++moved;
    }
  return moved;
}

struct Case {
  const char* name;
  int slots, groups, nodes, gpus;
};

void run_case(const Case& c, double sigma, bool mild = false) {
  std::mt19937_64 rng(2024);
  const int L = 8, E = 256;
  const double bytes = expert_bytes("deepseek-v3");
  Loads w0 = heavy_loads(rng, L, E);
  Placement current = rebalance(w0, c.slots, c.groups, c.nodes, c.gpus);
  Loads w1 = drift(w0, rng, sigma, mild);
  Placement fresh = rebalance(w1, c.slots, c.groups, c.nodes, c.gpus);
  const BalanceReport fresh_r = balance_report(fresh, w1), stale_r = balance_report(current, w1);

  for (bool per_layer : {true, false}) {
    MigrationResult m = rebalance_with_fewer_moves(w1, current, 0.01, per_layer);
    const BalanceReport ours_r = balance_report(m.placement, w1);
    // The promise: worst layer within 1% of the fresh rebalance's; with the per-layer target,
    // every layer within 1% of its fresh figure.
    EXPECT_DOUBLE_EQ(m.fresh_worst_balancedness, fresh_r.worst_balancedness_after);
    EXPECT_GE(ours_r.worst_balancedness_after, 0.99 * fresh_r.worst_balancedness_after - 1e-12);
    if (per_layer) {
      for (int l = 0; l < L; ++l)
        EXPECT_GE(ours_r.balancedness_after[l], 0.99 * fresh_r.balancedness_after[l] - 1e-12) << "layer " << l;
    }
    // Moves as counted by hand, for both.
    EXPECT_EQ(m.replicas_moved, moves_by_hand(current, m.placement));
    EXPECT_EQ(m.fresh_replicas_moved, moves_by_hand(current, fresh));
    // Kept replicas stay in their very slot: changed slots == replicas moved.
    int64_t changed = 0;
    for (size_t i = 0; i < current.phy2log.size(); ++i) changed += current.phy2log[i] != m.placement.phy2log[i];
    EXPECT_EQ(changed, m.replicas_moved);
    // Groups stay inside nodes in hierarchical mode, every expert keeps a replica.
    if (m.placement.hierarchical())
      for (int l = 0; l < L; ++l) {
        std::vector<std::set<int>> nodes(c.groups);
        for (int s = 0; s < c.slots; ++s)
          nodes[m.placement.phy2log_row(l)[s] / (E / c.groups)].insert(s / (c.slots / c.nodes));
        for (const auto& n : nodes) EXPECT_EQ(n.size(), 1u);
      }
    for (int32_t n : m.placement.replica_count) EXPECT_GE(n, 1);
    // The gain: at least 2x (per-layer target) or 3x (worst-layer target) fewer replicas.
    EXPECT_LT((per_layer ? 2 : 3) * m.replicas_moved, m.fresh_replicas_moved);

    fmt::print(
        "[fewer moves] {} ({} layers x {} experts, {} slots, drift sigma {}{}), {} target: balancedness mean/worst "
        "layer: stale {:.4f}/{:.4f}, fresh {:.4f}/{:.4f}, ours {:.4f}/{:.4f}; replicas moved: fresh {} ({:.1f} GB), "
        "ours {} ({:.1f} GB), {:.1f}x fewer\n",
        c.name, L, E, c.slots, sigma, mild ? "" : " + 2 hot/cold swaps per layer",
        per_layer ? "per-layer" : "worst-layer", stale_r.mean_balancedness_after, stale_r.worst_balancedness_after,
        fresh_r.mean_balancedness_after, fresh_r.worst_balancedness_after, ours_r.mean_balancedness_after,
        ours_r.worst_balancedness_after, m.fresh_replicas_moved, m.fresh_replicas_moved * bytes / 1e9, m.replicas_moved,
        m.replicas_moved * bytes / 1e9, double(m.fresh_replicas_moved) / std::max<int64_t>(1, m.replicas_moved));
  }
}

}  // namespace

TEST(EplbMigration, HierarchicalFewerMoves) { run_case({"hierarchical 4 nodes x 8 GPUs", 288, 8, 4, 32}, 0.1); }
TEST(EplbMigration, HierarchicalMildDrift) { run_case({"hierarchical 4 nodes x 8 GPUs", 288, 8, 4, 32}, 0.1, true); }
TEST(EplbMigration, GlobalFewerMoves) { run_case({"global 144 GPUs", 288, 8, 18, 144}, 0.1); }

TEST(EplbMigration, UnchangedLoadsMoveNothing) {
  std::mt19937_64 rng(5);
  Loads w = heavy_loads(rng, 4, 64);
  Placement current = rebalance(w, 80, 8, 2, 16);
  MigrationResult m = rebalance_with_fewer_moves(w, current);
  EXPECT_EQ(m.replicas_moved, 0);
  EXPECT_EQ(m.placement.phy2log, current.phy2log);
}

TEST(EplbMigration, ExpertBytesFromSpec) {
  // DeepSeek-V3: gate, up and down of 7168 x 2048 in FP8 (1 byte): 44 MB per expert per layer.
  EXPECT_DOUBLE_EQ(expert_bytes("deepseek-v3"), 3.0 * 7168 * 2048 * 1);
}

TEST(EplbMigration, RejectsMismatchedLoads) {
  Placement current = rebalance({{1, 2, 3, 4}}, 4, 1, 1, 2);
  EXPECT_THROW(rebalance_with_fewer_moves({{1, 2, 3}}, current), Error);
  EXPECT_THROW(rebalance_with_fewer_moves({{1, 2, 3, 4}, {1, 2, 3, 4}}, current), Error);
  EXPECT_THROW(rebalance_with_fewer_moves({{1, 2, 3, 4}}, current, 1.5), Error);
}

// On many random shapes, loads and drifts: the target always holds, every expert keeps a
// replica, groups stay inside nodes, and the moves reported are the moves made.
TEST(EplbMigration, PropertiesOnRandomDrifts) {
  struct Shape {
    int experts, slots, groups, nodes, gpus;
  };
  const std::vector<Shape> shapes = {{12, 16, 4, 2, 8},  {64, 80, 8, 2, 16}, {64, 72, 8, 4, 8},
                                     {32, 48, 4, 3, 12}, {16, 16, 4, 2, 4},  {48, 64, 6, 2, 32}};
  std::mt19937_64 rng(99);
  for (int trial = 0; trial < 20; ++trial)
    for (const Shape& s : shapes) {
      Loads w0 = heavy_loads(rng, 3, s.experts);
      Placement current = rebalance(w0, s.slots, s.groups, s.nodes, s.gpus);
      Loads w1 = drift(w0, rng, 0.3);
      MigrationResult m = rebalance_with_fewer_moves(w1, current, 0.01);
      const BalanceReport r = balance_report(m.placement, w1);
      EXPECT_GE(r.worst_balancedness_after, m.target_balancedness - 1e-12);
      EXPECT_LE(m.replicas_moved, m.fresh_replicas_moved);
      EXPECT_EQ(m.replicas_moved, moves_by_hand(current, m.placement));
      for (int32_t n : m.placement.replica_count) EXPECT_GE(n, 1);
      if (m.placement.hierarchical())
        for (int l = 0; l < 3; ++l) {
          std::vector<std::set<int>> nodes(s.groups);
          for (int p = 0; p < s.slots; ++p)
            nodes[m.placement.phy2log_row(l)[p] / (s.experts / s.groups)].insert(p / (s.slots / s.nodes));
          for (const auto& n : nodes) EXPECT_EQ(n.size(), 1u);
        }
      if (HasFailure()) return;
    }
}
