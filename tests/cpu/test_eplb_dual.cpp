// Both barrier loads: GEMM rows and de-duplicated received tokens, on a skewed trace with hot
// experts and correlated expert choices. Balancing the larger of the two must lower the worse
// of the two maxima versus packing by counts alone; the figures are printed.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "moekit/check.h"
#include "moekit/eplb.h"

using namespace moekit;

namespace {

// Tokens follow "topics": a Zipf-popular topic owns a set of experts and a token takes most of
// its k experts from its topic (correlated choices), the rest from a Zipf-hot global
// popularity (hot experts). Seeded, so the figures are reproducible.
RoutingTrace skewed_trace(int num_layers, int num_steps, int tokens_per_step, int num_experts, int topk, int num_ranks,
                          uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int num_topics = 16, topic_size = 8;
  auto zipf = [](int n, double s) {
    std::vector<double> p(n);
    for (int i = 0; i < n; ++i) p[i] = 1.0 / std::pow(i + 1, s);
    return p;
  };
  RoutingTrace t;
  t.num_experts = num_experts;
  t.topk = topk;
  t.num_ranks = num_ranks;
  for (int l = 0; l < num_layers; ++l) {
    std::vector<std::vector<int>> topics(num_topics);
    for (auto& topic : topics) {
      std::set<int> members;
      std::uniform_int_distribution<int> any(0, num_experts - 1);
      while (int(members.size()) < topic_size) members.insert(any(rng));
      topic.assign(members.begin(), members.end());
    }
    std::vector<int> hot_order(num_experts);
    for (int e = 0; e < num_experts; ++e) hot_order[e] = e;
    std::shuffle(hot_order.begin(), hot_order.end(), rng);
    const auto topic_weight = zipf(num_topics, 1.1);
    std::discrete_distribution<int> pick_topic(topic_weight.begin(), topic_weight.end());
    auto hot = zipf(num_experts, 1.0);
    std::discrete_distribution<int> pick_hot(hot.begin(), hot.end());
    std::bernoulli_distribution from_topic(0.85);
    auto& steps = t.layers.emplace_back();
    for (int s = 0; s < num_steps; ++s) {
      auto& flat = steps.emplace_back();
      for (int tok = 0; tok < tokens_per_step; ++tok) {
        const auto& topic = topics[pick_topic(rng)];
        std::set<int> chosen;
        while (int(chosen.size()) < topk) {
          if (from_topic(rng))
            chosen.insert(topic[std::uniform_int_distribution<int>(0, topic_size - 1)(rng)]);
          else
            chosen.insert(hot_order[pick_hot(rng)]);
        }
        flat.insert(flat.end(), chosen.begin(), chosen.end());
      }
    }
  }
  return t;
}

// Rows and received tokens counted independently: route with choose_replicas, then a set of
// GPUs per token.
DualLoads loads_by_sets(const Placement& p, const RoutingTrace& t, uint64_t seed) {
  DualLoads d;
  d.num_gpus = p.num_gpus;
  d.gemm_rows.assign(size_t(p.num_layers) * p.num_gpus, 0);
  d.recv_tokens.assign(size_t(p.num_layers) * p.num_gpus, 0);
  for (int l = 0; l < p.num_layers; ++l)
    for (const auto& step : t.layers[l]) {
      const int T = int(step.size()) / t.topk;
      std::vector<int32_t> slot(step.size());
      choose_replicas(p, l, step.data(), T, t.topk, seed, slot.data());
      for (int tok = 0; tok < T; ++tok) {
        std::set<int> gpus;
        for (int j = 0; j < t.topk; ++j) {
          int g = slot[size_t(tok) * t.topk + j] / p.slots_per_gpu();
          ++d.gemm_rows[size_t(l) * p.num_gpus + g];
          gpus.insert(g);
        }
        for (int g : gpus) ++d.recv_tokens[size_t(l) * p.num_gpus + g];
      }
    }
  return d;
}

struct Figures {
  double rows, recv;  // max / normaliser, worst layer
};

Figures figures(const DualLoads& d, const DualLoads& counts, int layers) {
  Figures f{0, 0};
  const int G = d.num_gpus;
  for (int l = 0; l < layers; ++l) {
    double rows_sum = 0, recv_sum = 0, rows_max = 0, recv_max = 0;
    for (int g = 0; g < G; ++g) {
      rows_sum += counts.gemm_rows[size_t(l) * G + g];
      recv_sum += counts.recv_tokens[size_t(l) * G + g];
      rows_max = std::max(rows_max, double(d.gemm_rows[size_t(l) * G + g]));
      recv_max = std::max(recv_max, double(d.recv_tokens[size_t(l) * G + g]));
    }
    f.rows = std::max(f.rows, rows_max / (rows_sum / G));
    f.recv = std::max(f.recv, recv_max / (recv_sum / G));
  }
  return f;
}

void run_case(const char* name, int slots, int groups, int nodes, int gpus) {
  const int L = 2, E = 64, k = 6;
  RoutingTrace trace = skewed_trace(L, 8, 1024, E, k, gpus, 11);
  DualResult r = rebalance_dual(trace, slots, groups, nodes, gpus, 3);

  // Independent recount of both loads for both placements.
  DualLoads counts = loads_by_sets(r.counts_placement, trace, 3), dual = loads_by_sets(r.placement, trace, 3);
  EXPECT_EQ(counts.gemm_rows, r.counts_loads.gemm_rows);
  EXPECT_EQ(counts.recv_tokens, r.counts_loads.recv_tokens);
  EXPECT_EQ(dual.gemm_rows, r.loads.gemm_rows);
  EXPECT_EQ(dual.recv_tokens, r.loads.recv_tokens);
  // The counts placement is exactly the reference on the trace's counts.
  EXPECT_EQ(r.counts_placement.phy2log, rebalance(trace_loads(trace), slots, groups, nodes, gpus).phy2log);

  // The same search on rows alone: what routing exactly (without the receive term) gives.
  DualResult rows_only = rebalance_dual(trace, slots, groups, nodes, gpus, 3, false);
  const Figures rows_f = figures(loads_by_sets(rows_only.placement, trace, 3), counts, L);
  const double worse_rows_only = std::max(rows_f.rows, rows_f.recv);

  const Figures before = figures(counts, counts, L), after = figures(dual, counts, L);
  const double worse_before = std::max(before.rows, before.recv), worse_after = std::max(after.rows, after.recv);
  EXPECT_NEAR(worse_before, r.counts_worst_imbalance, 1e-12);
  EXPECT_NEAR(worse_after, r.worst_imbalance, 1e-12);
  EXPECT_LT(worse_after, worse_before - 0.02) << "balancing both loads should lower the worse maximum";
  EXPECT_LT(worse_after, worse_rows_only) << "the receive term should matter beyond exact row balancing";
  // Every expert keeps a replica, and the replica counts are the reference's.
  EXPECT_EQ(r.placement.replica_count, r.counts_placement.replica_count);
  if (r.placement.hierarchical())
    for (int l = 0; l < L; ++l) {
      std::vector<std::set<int>> nodes_of(groups);
      for (int s = 0; s < slots; ++s)
        nodes_of[r.placement.phy2log_row(l)[s] / (E / groups)].insert(s / (slots / nodes));
      for (const auto& n : nodes_of) EXPECT_EQ(n.size(), 1u);
    }
  fmt::print(
      "[dual loads] {} ({} layers, {} experts, top-{}, {} slots, {} GPUs, 8 steps x 1024 tokens): "
      "max/mean GEMM rows {:.3f} -> {:.3f}, max/mean received tokens {:.3f} -> {:.3f}, "
      "worse of the two {:.3f} (counts alone) -> {:.3f} (both); the same search on rows only: rows {:.3f}, "
      "received {:.3f}, worse {:.3f}\n",
      name, L, E, k, slots, gpus, before.rows, after.rows, before.recv, after.recv, worse_before, worse_after,
      rows_f.rows, rows_f.recv, worse_rows_only);
}

}  // namespace

TEST(EplbDual, LoadsByHand) {
  // Slots [0, 2, 3 | 0, 1, 1]: expert 0 on both GPUs, expert 1 twice on GPU 1.
  Placement p = placement_from_phy2log({0, 2, 3, 0, 1, 1}, 1, 4, 6, 1, 1, 2);
  RoutingTrace t;
  t.num_experts = 4, t.topk = 2, t.num_ranks = 2;
  // Tokens 0, 1 on rank 0; tokens 2, 3 on rank 1.
  t.layers = {{{0, 2, 0, 1, 2, 3, 1, 0}}};
  DualLoads d = dual_loads(p, t, 0);
  // Token 0 (rank 0): 0 -> own slot 0, 2 -> GPU 0: 2 rows, 1 token on GPU 0.
  // Token 1 (rank 0): 0 -> GPU 0, 1 -> GPU 1: GPU 0 and 1 each get a row and a token.
  // Token 2 (rank 1): 2 -> GPU 0, 3 -> GPU 0: 2 rows, 1 token on GPU 0.
  // Token 3 (rank 1): 1 -> GPU 1, 0 -> own slot 3 on GPU 1: 2 rows, 1 token on GPU 1.
  EXPECT_EQ(d.gemm_rows, (std::vector<int64_t>{5, 3}));
  EXPECT_EQ(d.recv_tokens, (std::vector<int64_t>{3, 2}));
}

TEST(EplbDual, GlobalBothLoadsBeatCountsAlone) { run_case("global", 80, 1, 1, 16); }
TEST(EplbDual, HierarchicalBothLoadsBeatCountsAlone) { run_case("hierarchical 2 nodes", 80, 8, 2, 16); }

TEST(EplbDual, RejectsMismatchedTrace) {
  RoutingTrace t;
  t.num_experts = 8, t.topk = 2, t.num_ranks = 1;
  t.layers = {{{0, 1}}};
  Placement p = rebalance({{1, 1, 1, 1}}, 4, 1, 1, 2);
  EXPECT_THROW(dual_loads(p, t, 0), Error);
}
